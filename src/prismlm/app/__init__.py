"""The application layer: open a run once (``Run``), then do an operation — each ``prism`` command is one
plain function here, returning values, never printing; user mistakes raise ``prismlm.errors.PrismError``.

    from prismlm.app import Run, generate, explain_text
    run = Run.open("runs/demo")
    print(generate(run, "It is a truth", tokens=20)[0])
"""

from prismlm.app.attribution import attribute_explanation, attribute_text, build_run_cache, build_run_search
from prismlm.app.control import build_task_folders, evaluate_tasks, find_run_concept, fit_controller
from prismlm.app.demos import demo
from prismlm.app.indexing import build_run_index, label_prototypes, merge_index_parts
from prismlm.app.operations import (
    ExplanationRequest,
    evaluate,
    explain_text,
    find_prototypes,
    generate,
    prototypes,
    sample_continuations,
    show_prototype,
    verify_run,
)
from prismlm.app.retrofit import retrofit_model
from prismlm.app.run import Run, StageFn
from prismlm.app.training import build_config, prepare, train_from_options

__all__ = [
    "ExplanationRequest",
    "Run",
    "StageFn",
    "attribute_explanation",
    "attribute_text",
    "build_config",
    "build_run_cache",
    "build_run_search",
    "build_run_index",
    "build_task_folders",
    "demo",
    "evaluate",
    "evaluate_tasks",
    "explain_text",
    "find_prototypes",
    "find_run_concept",
    "fit_controller",
    "generate",
    "label_prototypes",
    "merge_index_parts",
    "prepare",
    "prototypes",
    "retrofit_model",
    "sample_continuations",
    "show_prototype",
    "train_from_options",
    "verify_run",
]
