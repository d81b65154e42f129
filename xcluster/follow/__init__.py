"""The subscriber daemon: model directories, engine hand-off and metrics (torch lives here)."""
