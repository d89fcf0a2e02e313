"""What the tp stage (stages/tp.py) needs besides the ops it inherits: who owns which slice of
the model (split.py), how a rank maps only its slices of the file (shards.py), and how the
ranks talk, each collective with a deadline (ranks.py)."""
