"""zoo's engine: everything a run needs below the front and the plugins, in rooms.

Each room is a package whose `__init__` is its face, the names the rest of zoo uses:
`loop` (running a run), `checkpoints` (writing, reading, resuming), `report` (TensorBoard,
the console, what a run says of itself), `steps` (what one step computes), `weights`
(checkpoints of the PyTorch ecosystem in and out, adapters, float32 masters), `pipeline` (Grain
batches), `kernels` (the dense layer, attention and the CPU kernels behind them) and `sharding`
(meshes, rules, plans). Beside them stand `errors`, `config` (the typed schema) and `registry`
(the records of models, data sets and checkpoint families). The front imports faces only, and
plugins reach the engine through `zoo.plugin` (import-linter contracts in pyproject.toml).
"""
