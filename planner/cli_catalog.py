"""`planner profiles`, `planner stacks` and `planner models`: what the planner knows of devices, clusters,
software stacks and models, listed and shown field by field."""
from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console

from hardware_profiles.loader import list_stacks, load_stack, resolve_stack
from hardware_profiles.stack import DEFAULT_STACK

from . import views
from .cli_options import HELP, JsonOpt, LeafOpt, SeqOpt, StrictOpt, leaf_names
from .graph_capture.model_sources import list_builtin_models
from .job import capture_for

profiles_app = typer.Typer(no_args_is_help=True, context_settings=HELP, help="Device and cluster profiles.")
stacks_app = typer.Typer(no_args_is_help=True, context_settings=HELP, help="Software-stack profiles: what each "
                         "framework runs, fuses, overlaps and holds.")
models_app = typer.Typer(no_args_is_help=True, context_settings=HELP,
                         help="Built-in models and what capture finds in them.")
out = Console()


@profiles_app.command("list")
def profiles_list(as_json: bool = JsonOpt) -> None:
    """Every built-in device and cluster profile."""
    if as_json:
        out.print_json(json.dumps(views.profiles_summary()))
    else:
        views.show_profiles(out)


@profiles_app.command("show")
def profiles_show(name: str = typer.Argument(..., help="a device or cluster name, or a YAML path"),
                  as_json: bool = JsonOpt) -> None:
    """One profile, field by field."""
    profile = views.load_profile(name)
    if as_json:
        out.print_json(json.dumps({"kind": type(profile).__name__.lower(), **profile.model_dump(mode="json")}))
    else:
        views.show_profile(out, profile)


@stacks_app.command("list")
def stacks_list(as_json: bool = JsonOpt) -> None:
    """Every built-in software stack, one line each."""
    stacks = [(name, load_stack(name)) for name in list_stacks()]
    if as_json:
        out.print_json(json.dumps([{"name": name, "display_name": stack.display_name, "default": name == DEFAULT_STACK}
                                   for name, stack in stacks]))
        return
    for name, stack in stacks:
        default = "  (default)" if name == DEFAULT_STACK else ""
        out.print(f"{name:18s} {stack.display_name}{default}", highlight=False)


@stacks_app.command("show")
def stacks_show(name: str = typer.Argument(..., help="a stack name or a YAML path"),
                as_json: bool = JsonOpt) -> None:
    """One stack, field by field: what the search may use and what the cost models assume."""
    stack = load_stack(name)
    if as_json:
        out.print_json(stack.model_dump_json())
        return
    for field, value in stack.model_dump().items():
        shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        out.print(f"{field:22s} {shown}", highlight=False)


@models_app.command("list")
def models_list(as_json: bool = JsonOpt) -> None:
    """Built-in models."""
    if as_json:
        out.print_json(json.dumps(list_builtin_models()))
    else:
        views.show_models(out)


@models_app.command("show")
def models_show(name: str = typer.Argument(..., help="built-in name, YAML, config.json or file.py:factory"),
                seq_len: Optional[int] = SeqOpt, as_json: bool = JsonOpt,
                leaf_modules: str = LeafOpt, strict_capture: bool = StrictOpt) -> None:
    """Parameters, layers by kind and FLOPs per token, from the captured graph."""
    graph = capture_for(name, seq_len, leaf_names(leaf_modules), resolve_stack(None), strict_capture)
    summary = views.model_summary(graph)
    if as_json:
        out.print_json(json.dumps(summary))
    else:
        views.show_model(out, graph, summary)
