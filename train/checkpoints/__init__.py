"""A run's checkpoints: writing them (`manager`), reading them without writing (`reader`),
their checksums, where a run starts (`start`: its own checkpoint, another run's weights or its
seed), which checkpoint a resume takes (`resume`), another run's weights as a fine-tune's start
(`warm_start`), and the storage stack's failures in one line each (`failures`)."""
