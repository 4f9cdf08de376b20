"""Build a model from `config.json` and fill it from safetensors (single file or sharded) or with dummy weights."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Collection, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import ELSEWHERE, WHOLE, Shard, zero_padding
from radixmesh.engine.models.registry import model_class
from radixmesh.engine.models.support import check_servable, check_tensor_dtype, check_unexpected_tensors
from radixmesh.engine.quantization import fp8_load, mxfp4
from radixmesh.engine.quantization.fp8 import FP8, Fp8Scheme, checkpoint_scheme, dequantize, quantized_online, scale_of
from radixmesh.engine.quantization.kv_scales import KvScales, check_scale, collect, from_param_file, kv_scale_of

log = logging.getLogger(__name__)

# Checkpoint tensors that carry nothing the model computes with: RoPE frequencies (recomputed from config.json).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# GLM-4.x checkpoints publish their multi-token-prediction layer in this file, which their index does not list: read
# with the rest (the models skip it unless it drafts: engine.speculative.nextn)
MTP_FILE = "mtp.safetensors"


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"weight shard(s) listed in {index} are missing: {', '.join(missing)}")
        mtp = os.path.join(path, MTP_FILE)
        return files + [mtp] if os.path.isfile(mtp) and mtp not in files else files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path} (expected model.safetensors or "
                                f"model.safetensors.index.json)")
    return found


def iter_checkpoint(path: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy tensor) for every tensor of the checkpoint: index it to read (a part, or [:] for all)."""
    for file in checkpoint_files(path):
        try:
            handle = safe_open(file, framework="pt", device="cpu")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"cannot read weight file {file}: {e}") from e
        for name in names:
            try:
                yield name, handle.get_slice(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"cannot read tensor {name!r} from weight file {file}: {e}") from e


def model_tensors(cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """iter_checkpoint under the names the model class reads: a class whose checkpoints nest its weights elsewhere
    (a multimodal model served text-only) renames each stored name with its static `checkpoint_name`, which returns
    None for a tensor the engine does not serve (a vision tower), skipped unread. An MXFP4 checkpoint's experts read
    as their dequantized tensors (engine.quantization.mxfp4)."""
    try:
        rename = getattr(model_class(cfg.architecture), "checkpoint_name", None)
    except ValueError:  # an architecture no class serves: its tensors under their stored names
        rename = None
    stored = iter_checkpoint(cfg.path)
    for name, lazy in (mxfp4.paired(stored) if mxfp4.is_mxfp4(cfg.raw) else stored):
        if rename is not None and (name := rename(name)) is None:
            continue
        yield name, lazy


_RAW_SUFFIXES = ("_blocks", "_scales")  # MXFP4 codes and scales read as stored (uint8)


def _raw_mxfp4(tensors: Iterator[tuple[str, Any]], targets: Collection[str]) -> Iterator[tuple[str, Any]]:
    """An MXFP4 tensor (engine.quantization.mxfp4.LazyMxfp4) whose model holds its codes and scales as stored
    (`<name>_blocks` and `<name>_scales` parameters: engine.models.gpt_oss) read as those two; the rest as given."""
    for name, lazy in tensors:
        if isinstance(lazy, mxfp4.LazyMxfp4) and f"{name}_blocks" in targets:
            yield f"{name}_blocks", lazy.blocks
            yield f"{name}_scales", lazy.scales
        else:
            yield name, lazy


def checkpoint_name_map(model: nn.Module) -> dict[str, list[tuple[nn.Parameter, Shard]]]:
    """Hugging Face tensor name -> the (our parameter, the part of it and of the tensor) it fills, for every weight
    the model needs: one, or several where a checkpoint tensor holds parts a rank keeps apart (Phi-3's fused qkv_proj
    under tensor parallelism). Layers that fuse or shard weights say where each tensor goes (`checkpoint_shards`)."""
    out: dict[str, list[tuple[nn.Parameter, Shard]]] = {}
    for pname, param in model.named_parameters():
        mod_path, leaf = pname.rsplit(".", 1)
        module = model.get_submodule(mod_path)
        owner = mod_path.rpartition(".")[0]
        shards = module.checkpoint_shards(leaf) if hasattr(module, "checkpoint_shards") else [(None, WHOLE)]
        for ckpt_module, shard in shards:
            name = pname if ckpt_module is None else f"{owner}.{ckpt_module}.{leaf}".lstrip(".")
            out.setdefault(name, []).append((param, shard))
    return out


def _read(lazy, shard: Shard) -> torch.Tensor:
    """The part of a checkpoint tensor `shard` takes, read from the file alone."""
    if shard.dim is None:
        return lazy[:]
    return lazy[(slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)]


def _target_name(name: str, targets: Collection[str], cfg: ModelConfig, skipped: Collection[str] = ()
                 ) -> str | None:
    """The checkpoint_name_map key a checkpoint tensor fills (possibly not in `targets`), or None for a tensor that
    is harmless to skip: one of _IGNORED_SUFFIXES, lm_head.weight under tied embeddings (transformers, too, computes
    logits with the embedding then), or one the model class reads otherwise (its `skipped_tensors`)."""
    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings) or name in skipped:
        return None
    if name not in targets and f"model.{name}" in targets:  # a bare backbone (sentence-transformers saves)
        return f"model.{name}"
    return name


def _check_checkpoint(targets: Collection[str], cfg: ModelConfig, skipped: Collection[str] = ()) -> None:
    """Refuses, from the weight files' headers alone (no weight read), a checkpoint with a tensor the model has no
    parameter for or one stored in a dtype that is not a float (engine.models.support); fp8 weights and their scales
    are read when config.json declares fp8 (engine.quantization.fp8), KV cache scales by `load_kv_scales`."""
    fp8 = checkpoint_scheme(cfg.raw)
    unexpected = []
    for name, lazy in _raw_mxfp4(model_tensors(cfg), targets):
        if kv_scale_of(name, cfg.num_layers) is not None:
            continue
        if fp8 is not None and (scaled := scale_of(name)) is not None and \
                _target_name(scaled[0], targets, cfg) in targets:
            continue  # a weight's scale: read with the weight
        target = _target_name(name, targets, cfg, skipped)
        if target is None:
            continue
        if target in targets:
            raw = mxfp4.is_mxfp4(cfg.raw) and name.endswith(_RAW_SUFFIXES) and lazy.get_dtype() == "U8"
            if not (fp8 is not None and lazy.get_dtype() == "F8_E4M3") and not raw:
                check_tensor_dtype(name, lazy.get_dtype(), cfg.path)
        else:
            unexpected.append(name)
    check_unexpected_tensors(unexpected, cfg)


def _fp8_scales(cfg: ModelConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Weight name -> {scale kind: tensor} of every fp8 scale in the checkpoint (small: read whole)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, lazy in model_tensors(cfg):
        if (scaled := scale_of(name)) is not None:
            out.setdefault(scaled[0], {})[scaled[1]] = lazy[...]  # ([:] cannot index a scalar scale)
    return out


def _cut(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part of a whole tensor `shard` takes (as _read does from the file)."""
    if shard.dim is None:
        return full
    return full.narrow(shard.dim, shard.start, shard.length)


def _weight(name: str, lazy, shard: Shard, fp8: Fp8Scheme | None, scales: dict, online: bool) -> torch.Tensor:
    """What the checkpoint tensor `name` puts in its parameter: an fp8 weight dequantized with its scales, a weight
    rounded to fp8 (--quantization fp8), else the tensor as stored; this rank's part of it."""
    if fp8 is not None and lazy.get_dtype() == "F8_E4M3":
        scale = scales.get(name, {}).get(fp8.scale_name)
        if scale is None:
            raise ValueError(f"fp8 tensor {name!r} has no {fp8.scale_name} beside it in the checkpoint "
                             f"(quantization_config: {'block-wise' if fp8.block else 'per-tensor or per-channel'})")
        return _cut(dequantize(lazy[:], scale, fp8.block), shard)
    if online:
        return _cut(quantized_online(name, lazy[:]), shard)
    return _read(lazy, shard)


def _destination(param: nn.Parameter, shard: Shard) -> torch.Tensor:
    return param.data if shard.dest is None else param.data[shard.dest]


def _check_shape(name: str, lazy, param: nn.Parameter, shard: Shard, cfg: ModelConfig) -> None:
    dest = _destination(param, shard)
    full = tuple(lazy.get_shape())
    expected = list(dest.shape)
    if shard.dim is not None:
        expected[shard.dim] = full[shard.dim]  # the whole tensor the shard is cut from
        if shard.start + shard.length > full[shard.dim]:
            expected = None
    if expected is None or tuple(expected) != full:
        raise ValueError(f"tensor {name!r} in {cfg.path} has shape {full}, expected "
                         f"{tuple(expected) if expected else tuple(dest.shape)} (this rank's part: "
                         f"{tuple(dest.shape)})")


def _load_weights(model: nn.Module, cfg: ModelConfig, quantization: str | None = None) -> None:
    targets = checkpoint_name_map(model)
    fp8 = checkpoint_scheme(cfg.raw)
    scales = _fp8_scales(cfg) if fp8 is not None else {}
    online = quantization == "fp8" and fp8 is None
    held = {id(m.weight): m for m in model.modules() if getattr(m, "fp8", None) is not None}  # fp8_load.hold_fp8
    seen: set[str] = set()
    for name, lazy in _raw_mxfp4(model_tensors(cfg), targets):
        if (fp8 is not None and scale_of(name) is not None) or kv_scale_of(name, cfg.num_layers) is not None:
            continue
        stored, name = name, _target_name(name, targets, cfg, getattr(model, "skipped_tensors", ()))
        if name is None:
            continue
        for param, shard in targets[name]:  # load_model's _check_checkpoint refused every other name
            if shard is not ELSEWHERE:
                _check_shape(name, lazy, param, shard, cfg)
                if id(param) in held:
                    fp8_load.fill(held[id(param)], stored, lazy, shard, fp8, scales, _read)
                else:
                    _destination(param, shard).copy_(_weight(stored, lazy, shard, fp8, scales, online))
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        hint = (" (config.json has tie_word_embeddings=false: set it true if the output layer shares the embedding's "
                "weights)") if "lm_head.weight" in missing else ""
        raise ValueError(f"checkpoint {cfg.path} is missing tensor(s): {shown}{hint}")


def _hold_fp8(model: nn.Module, cfg: ModelConfig, load_format: str, quantization: str | None, backend: str,
              device: torch.device) -> None:
    """The projections whose weights stay fp8 (engine.quantization.fp8_load), while the model is on meta."""
    scheme = checkpoint_scheme(cfg.raw)
    if (scheme is None and quantization != "fp8") or not fp8_load.kernels_wanted(backend, device):
        return
    names_of: dict[int, list[str]] = {}
    for name, parts in checkpoint_name_map(model).items():
        for param, _ in parts:
            names_of.setdefault(id(param), []).append(name)
    dtypes = None
    if load_format != "dummy":
        dtypes = {name: "online" if scheme is None else lazy.get_dtype() for name, lazy in model_tensors(cfg)}
    fp8_load.hold_fp8(model, names_of, dtypes, scheme, device)


def load_kv_scales(cfg: ModelConfig, kv_cache_dtype: str, load_format: str, param_path: str | None = None,
                   tp_rank: int = 0, tp_size: int = 1, quiet: bool = False) -> KvScales | None:
    """The checkpoint's per-layer KV cache scales (engine.quantization.kv_scales) for an fp8 KV cache
    (`kv_cache_dtype` fp8_*), 1.0 for a layer without one, or this TP rank's from `param_path`
    (--quantization-param-path, which SGLang reads for an fp8_e4m3 cache, in place of the checkpoint's); None where
    the cache is not fp8 (the scales are then ignored) or the weights are dummy and no file is given. ValueError for
    a scale that is not one positive float, or a file that does not fit. `quiet`: log nothing (a second read, to
    name the scales)."""
    if not kv_cache_dtype.startswith("fp8"):
        if param_path is not None and not quiet:
            log.warning("--quantization-param-path %s is not read: KV cache scales apply to an fp8 KV cache, and "
                        "--kv-cache-dtype is %s", param_path, kv_cache_dtype)
        return None
    if param_path is not None:
        if kv_cache_dtype != "fp8_e4m3":
            raise ValueError(f"--quantization-param-path holds scales for an fp8_e4m3 KV cache (float8_e4m3fn), but "
                             f"--kv-cache-dtype is {kv_cache_dtype}")
        scales = from_param_file(param_path, tp_rank, tp_size, cfg.num_layers, cfg.raw.get("model_type"))
        if not quiet:
            log.info("KV cache scales for TP rank %d from %s (the checkpoint's, if any, are not used)", tp_rank,
                     param_path)
        return scales
    if load_format == "dummy":
        return None
    found = []
    for name, lazy in model_tensors(cfg):
        if kv_scale_of(name, cfg.num_layers) is not None:
            check_scale(name, lazy.get_dtype(), tuple(lazy.get_shape()), cfg.path)
            found.append((name, lazy[...]))  # ([:] cannot index a scalar)
    scales, given = collect(found, cfg.num_layers, cfg.path)
    if quiet or given == cfg.num_layers:
        return scales
    if given == 0:
        log.warning("--kv-cache-dtype %s: the checkpoint has no KV cache scales (k_scale / v_scale), so keys and "
                    "values are stored with scale 1.0; activations beyond fp8's range are clipped", kv_cache_dtype)
    else:
        log.warning("--kv-cache-dtype %s: the checkpoint gives KV cache scales for %d of %d layers; the others use "
                    "1.0", kv_cache_dtype, given, cfg.num_layers)
    return scales


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: norms at 1, everything else small and uniform (bounded activations); MXFP4
    codes random, their scales 2^-8 (weights up to ~0.02)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dtype == FP8:
            continue
        if param.dtype == torch.uint8:  # MXFP4
            if name.endswith("_scales"):
                param.data.fill_(127 - 8)
            else:
                param.data.random_(0, 256, generator=gen)
            continue
        if "norm" in name.rsplit(".", 2)[-2]:
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.02, 0.02, generator=gen)
    fp8_load.init_dummy(model, gen)


def load_model(cfg: ModelConfig, load_format: str, dtype: torch.dtype, device: torch.device,
               max_positions: int, seed: int = 0, tp: TensorParallel | None = None,
               quantization: str | None = None, fp8_gemm_backend: str = "auto") -> nn.Module:
    """The model on `device`, holding this rank's part of every weight under tensor parallelism. Refuses (ValueError)
    a config or checkpoint it would serve wrong before reading any weight (engine.models.support). fp8 checkpoints,
    and `quantization="fp8"` for an unquantized one, keep their projections in fp8 where fp8_load.kernels_wanted
    says so (engine.quantization.fp8_load), and are held dequantized otherwise (engine.quantization.fp8)."""
    cls = model_class(cfg.architecture)
    check_servable(cfg, max_positions)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(cfg, tp)
    if load_format != "dummy":
        _check_checkpoint(set(checkpoint_name_map(model)), cfg, getattr(model, "skipped_tensors", ()))
    _hold_fp8(model, cfg, load_format, quantization, fp8_gemm_backend, device)
    # what Module.to_empty does, with torch.empty: empty_like on a meta tensor goes through torch's Python
    # reference implementation, whose first call imports sympy (~1.3 s of CPU in every worker's start)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_weights(model, cfg, quantization)
    zero_padding(model)
    for module in model.modules():  # weights a layer holds otherwise than the checkpoint lays them out
        if hasattr(module, "after_load"):
            module.after_load()
    model.init_rotary(max_positions, device)
    return model.eval().requires_grad_(False)
