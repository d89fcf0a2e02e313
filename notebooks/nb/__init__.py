"""What the chapters in notebooks/ share: every chapter does `from notebooks import nb` and keeps
only its own story; a helper that two chapters need lives here, never in a notebook.

    settings.py   quick or full settings (LLM_NOTEBOOK_QUICK=1), the model (LLM_NOTEBOOK_MODEL)
    text.py       Markdown, tables, a function's code as the module has it now, the findings list
    measure.py    load, measure, profile (the harness of app/measure/bench.py), memory, records
    asm.py        the assembly of a kernel and the FMAs in it
    plots.py      live runs beside recorded ones, op shares, roofline, lines and bars
    journey.py    the running total that closes every stage's chapter: every stage against the floor
    article.py    the article's claims beside the live figures and the recorded verdicts

Measurements reuse the application's own tools, so a chapter's live figure and a recorded one
are the same kind of figure.
"""

import app

app.configure_numba()                  # a notebook is an entry point: numba's cache and threading layers

from common.cpu import cache_sizes  # this machine's caches, in bytes
from notebooks.nb import article  # noqa: E402
from notebooks.nb.asm import amx_kernel_asm, fma_counts, hot_loop, int8_row_kernels, integer_kernel_asm, kernel_asm
from notebooks.nb.journey import journey
from notebooks.nb.measure import (
    KeepLogits,
    MatmulWork,
    Recorded,
    best_seconds,
    ceilings,
    faults_between,
    find_records,
    load,
    matmul_work,
    measure,
    measure_in_subprocess,
    measure_live,
    measure_pair,
    memory_now,
    missing_stage,
    print_profile,
    profile,
    prompt_ids,
    recorded,
    recorded_ttft,
    recorded_vs_llama,
    show_vs_llama,
    step_ms,
    vs_llama_ratios,
)
from notebooks.nb.plots import (
    bar_chart,
    line_chart,
    matmul_share,
    ops_chart,
    ops_chart_with_records,
    roofline_chart,
    show,
    show_live,
    stage_chart,
)
from notebooks.nb.settings import MODEL_ENV, QUICK_ENV, ROOT, Settings, is_quick, model_path, rel, settings
from notebooks.nb.text import (
    Findings,
    class_source_from_file,
    find_kernels,
    human_bytes,
    md,
    md_table,
    module_kernels,
    show_class_from_file,
    show_file_excerpt,
    show_image,
    show_source,
    show_table,
)

__all__ = [
    "amx_kernel_asm", "article",
    "Findings", "KeepLogits", "MODEL_ENV", "MatmulWork", "QUICK_ENV", "ROOT", "Recorded", "Settings", "bar_chart",
    "best_seconds",
    "cache_sizes", "ceilings", "class_source_from_file", "faults_between", "find_kernels", "find_records",
    "fma_counts", "hot_loop", "int8_row_kernels", "integer_kernel_asm", "human_bytes", "is_quick", "journey",
    "kernel_asm",
    "line_chart", "load", "matmul_share",
    "matmul_work", "md", "md_table", "measure", "measure_in_subprocess", "measure_live", "measure_pair", "memory_now",
    "missing_stage", "model_path",
    "module_kernels", "ops_chart", "ops_chart_with_records", "print_profile", "profile", "prompt_ids", "recorded",
    "recorded_ttft", "recorded_vs_llama", "rel", "roofline_chart", "settings", "show", "show_class_from_file",
    "show_file_excerpt", "show_image", "show_live", "show_source", "show_table", "show_vs_llama", "stage_chart",
    "step_ms", "vs_llama_ratios",
]
