"""SGLang's LoRA flags resolved and checked (engine.config.resolve_args calls `resolve_lora`)."""

from __future__ import annotations

from typing import Any

from radixmesh.engine.lora.adapter import PROJECTIONS, adapted_projections, read_config
from radixmesh.engine.lora.stacks import FUSED

# our fused modules' names (SGLang's too) -> the peft projections each holds
MODULES = {attr: projs for (_, attr), projs in FUSED.items()}

DEFAULT_MAX_LORAS_PER_BATCH = 8  # SGLang's
# architectures peft adapters cannot be put on yet, and why
_NO_LORA = {"Starcoder2ForCausalLM": "its MLP (c_fc, c_proj) has no gate/up/down projections to adapt",
            "PhiForCausalLM": "its MLP (fc1, fc2) has no gate/up/down projections to adapt",
            "Gemma3ForConditionalGeneration": "its adapters also name the vision tower's projections (served "
                                              "text-only, it has none)"}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def parse_lora_paths(entries) -> list[tuple[str, str]]:
    """`name=path` or `path` (named by itself) entries, as SGLang's --lora-paths takes them."""
    out = []
    for entry in entries or ():
        name, sep, path = str(entry).partition("=")
        out.append((name, path) if sep else (entry, entry))
    names = [n for n, _ in out]
    _check(len(set(names)) == len(names), f"lora_paths names an adapter twice: {names}")
    return out


def resolve_targets(declared, paths: list[tuple[str, str]]) -> tuple[str, ...]:
    """The projections (peft names) that get LoRA weight slots, as SGLang resolves --lora-target-modules: the flag's
    modules (peft names or our fused modules' names; `all` alone: every one), else the union of those the adapters
    of --lora-paths adapt, else (no adapters to infer from, where SGLang asks for the flag) every one. A name stands
    for its whole fused module: the projections of one module share its slots (q/k/v, gate/up)."""
    if declared is None and not paths:
        return tuple(sorted(PROJECTIONS))
    if declared is None:
        names = set().union(*(adapted_projections(path) for _, path in paths))
    else:
        names = set(declared)
        if "all" in names:
            _check(len(names) == 1, f"lora_target_modules {sorted(names)}: 'all' is given alone")
            return tuple(sorted(PROJECTIONS))
        unknown = sorted(names - set(PROJECTIONS) - set(MODULES))
        _check(not unknown, f"lora_target_modules {unknown}: the modules that can be adapted are "
               f"{', '.join([*PROJECTIONS, *(m for m in MODULES if m not in PROJECTIONS)])} (or all)")
    return tuple(sorted({p for module, projs in MODULES.items() for p in projs
                         if module in names or names & set(projs)}))


def resolve_lora(args: Any, model: Any) -> dict:
    """The LoRA fields of the resolved arguments."""
    if not args.enable_lora:
        _check(not args.lora_paths, "lora_paths needs enable_lora (SGLang's --enable-lora)")
        return {}
    _check(model.architecture not in _NO_LORA,
           f"LoRA on {model.architecture} is not supported yet: {_NO_LORA.get(model.architecture)}")
    paths = parse_lora_paths(args.lora_paths)
    targets = resolve_targets(args.lora_target_modules, paths)
    rank = args.max_lora_rank
    if rank is None:  # SGLang: the largest rank among the adapters given at start
        ranks = [read_config(path).get("r") for _, path in paths]
        rank = max([r for r in ranks if isinstance(r, int)], default=0) or 64
    _check(isinstance(rank, int) and rank >= 1, f"max_lora_rank must be an integer >= 1, got {rank!r}")
    per_batch = args.max_loras_per_batch
    _check(isinstance(per_batch, int) and per_batch >= 1, f"max_loras_per_batch must be >= 1, got {per_batch!r}")
    loaded = args.max_loaded_loras if args.max_loaded_loras is not None else max(per_batch, len(paths))
    _check(loaded >= len(paths), f"max_loaded_loras ({loaded}) is below the {len(paths)} adapters in lora_paths")
    return {"max_lora_rank": rank, "max_loaded_loras": loaded,
            "lora_target_modules": targets,
            "lora_paths": tuple(f"{n}={p}" for n, p in paths) if paths else None}
