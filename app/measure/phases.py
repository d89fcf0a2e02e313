"""The compiled layer stack's phases by name, in stages/kernels/layer_stack.py's PHASES order (that
table numbers them; the records name them): what a stage's clock per phase is reported as, in the
profiled run of a record (app/measure/bench.py) and in the prompt sweeps (app/measure/ttft.py)."""

PHASE_NAMES = ("norm_attn", "qkv", "attend", "merge", "wo", "norm_ffn", "gate_up", "round_f", "down")
