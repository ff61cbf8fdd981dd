"""Speed measurements of zoo: printed tables and JSON, never timed assertions in tests."""
