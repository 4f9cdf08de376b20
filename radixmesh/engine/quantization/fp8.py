"""FP8 weights: checkpoints stored in float8_e4m3fn with their scales, and `--quantization fp8` (SGLang's flag) for
an unquantized checkpoint.

Formats read (config.json `quantization_config.quant_method` "fp8"; "compressed-tensors" with 8-bit float
weights, llm-compressor's layout: every scale named `weight_scale`; "modelopt" with `quant_algo` FP8, NVIDIA
ModelOpt's per-tensor layout, declared in config.json or in the hf_quant_config.json beside it):
  block-wise     `weight_block_size: [bn, bk]`, a `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] per weight (Hugging
                 Face's fine-grained FP8, DeepSeek-V3, Qwen3-FP8): w = q * scale of its block
  per-tensor     a scalar `weight_scale` (AutoFP8, ModelOpt), with a static `input_scale` when `activation_scheme` is
                 static (ModelOpt's always is)
  per-channel    `weight_scale` [N] or [N, 1]: one scale per output row
Layers the config keeps unquantized (`ignored_layers`, `modules_to_not_convert`, `exclude_modules`) are plain tensors
in the file.
`--quantization fp8` rounds each linear weight of an unquantized checkpoint to fp8 with one scale per output row
(the router of a mixture of experts, the embedding and the head stay as they are, as SGLang leaves them).

Where the fp8 kernels run (--fp8-gemm-backend auto on a CUDA GPU of sm89+, or triton), the projections keep their
weights in fp8 with their scales (engine.quantization.fp8_load) and run engine.quantization.fp8_linear: decode-sized
products read the fp8 weights with unquantized activations, larger ones quantize the activations per token (and
group) for fp8 GEMMs. Mixture-of-experts layers keep their experts in fp8 there too and run kernels.moe_fp8 (16-bit
activations with per-row scales; activations quantized per token and group with block scales). Elsewhere (CPU by
default) the weights are held dequantized in the model's dtype: the outputs are the fp8 weights' (the scales applied
exactly, in float32), the memory and the speed are not. Static `input_scale`s are read but not used: activations are
quantized dynamically per token where they are quantized at all. `write_checkpoint` is our writer of such
checkpoints (tests, tiny models); `dequantized_checkpoint` writes the float twin they are checked against."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixmesh.engine.model_config import HF_QUANT_FILE, with_quant_file

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALES = ("weight_scale_inv", "weight_scale", "input_scale")  # the tensors that travel with an fp8 weight
_STAYS = ("embed_tokens", "lm_head", "shared_expert_gate")  # never quantized online (nor by the writer), nor a router


def _quantizable(name: str, w: torch.Tensor) -> bool:
    """Whether --quantization fp8 (and our writer) rounds this tensor: a linear layer's 2-d weight, but the
    embedding, the head and a mixture of experts' routers (`mlp.gate`, Mixtral's `block_sparse_moe.gate`), which
    keep their dtype as SGLang leaves them."""
    return (w.dim() == 2 and name.endswith(".weight") and not any(s in name for s in _STAYS)
            and not name.endswith(".gate.weight"))


def _copy_side_files(src: str, dst: str, skip: tuple[str, ...]) -> None:
    """Every file of the model folder `src` but the weights and `skip` (config, tokenizer, ...) into `dst`."""
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in skip and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """A checkpoint's fp8 layout (config.json's quantization_config)."""

    block: tuple[int, int] | None  # weight_block_size; None: per-tensor or per-channel scales
    activation_scheme: str = "dynamic"
    scale_name: str = "weight_scale"  # the weight scale's tensor (`weight_scale_inv`: Hugging Face's block-wise)


def scheme_of(quant: dict) -> Fp8Scheme:
    """The scheme of a `quant_method: fp8` quantization_config; ValueError naming a field we cannot serve."""
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"fp8 quantization with fmt={fmt!r} (quantization_config in config.json) is not "
                         "implemented by radixmesh yet: only e4m3 weights are read")
    block = quant.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                              or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization_config.weight_block_size must be two positive integers, got {block!r}")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 quantization_config.activation_scheme must be dynamic or static, got {scheme!r}")
    return Fp8Scheme(tuple(block) if block else None, scheme, "weight_scale_inv" if block else "weight_scale")


def compressed_tensors_scheme(quant: dict) -> Fp8Scheme | None:
    """The fp8 scheme of a compressed-tensors quantization_config (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK:
    format float-quantized, 8-bit float weights per tensor, channel or block, scales in `weight_scale`); None when
    its weights are not fp8 (the caller refuses it by name); ValueError for fp8 we cannot read."""
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    if not weights or not all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
        return None
    where = "compressed-tensors quantization_config"
    if quant.get("format") != "float-quantized":
        raise ValueError(f"fp8 weights in {where} with format={quant.get('format')!r} are not implemented by "
                         "radixmesh yet: float-quantized is read")
    kinds = {(w.get("strategy"), tuple(w.get("block_structure") or ())) for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"fp8 weights in {where} mix strategies ({sorted(kinds)}): one strategy is read")
    (strategy, block), = kinds
    if strategy not in ("tensor", "channel", "block") or (strategy == "block") != bool(block):
        raise ValueError(f"fp8 weights in {where} with strategy={strategy!r} are not implemented by radixmesh yet: "
                         "tensor, channel and block (with its block_structure) are read")
    if block and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 block_structure must be two positive integers, got {list(block)!r}")
    acts = [g.get("input_activations") or {} for g in groups]
    static = any(a and not a.get("dynamic", True) for a in acts)
    return Fp8Scheme(block or None, "static" if static else "dynamic", "weight_scale")


# ModelOpt's quant_algo values -> the fp8 scheme their checkpoints hold (the others are refused by name: NVFP4,
# W4A8_AWQ, W4A16_AWQ, INT8_SQ, ...)
_MODELOPT_ALGOS = {"FP8": Fp8Scheme(None, "static", "weight_scale")}


def modelopt_scheme(quant: dict) -> Fp8Scheme:
    """The fp8 scheme of an NVIDIA ModelOpt quantization_config (quant_method "modelopt": its fields at the top or
    under `quantization`, as hf_quant_config.json nests them); ValueError naming a quant_algo we do not read."""
    algo = quant.get("quant_algo") or (quant.get("quantization") or {}).get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"NVIDIA ModelOpt quantization with quant_algo={algo!r} is not implemented by radixmesh "
                         f"yet: {', '.join(_MODELOPT_ALGOS)} is read (fp8 weights with a scalar weight_scale)")
    return _MODELOPT_ALGOS[algo]


def checkpoint_scheme(raw_config: dict) -> Fp8Scheme | None:
    """The fp8 scheme a config.json declares (quantization_config.quant_method fp8, compressed-tensors with fp8
    weights, or modelopt: engine.model_config.with_quant_file folds ModelOpt's hf_quant_config.json in), else
    None."""
    quant = raw_config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        return scheme_of(quant)
    if method == "compressed-tensors":
        return compressed_tensors_scheme(quant)
    if method == "modelopt":
        return modelopt_scheme(quant)
    return None


def scale_of(name: str) -> tuple[str, str] | None:
    """(the weight's name, the scale's kind) for a checkpoint tensor that is an fp8 weight's scale, else None."""
    for kind in SCALES:
        if name.endswith("." + kind):
            return name[: -len(kind)] + "weight", kind
    return None


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 weights [N, K] of fp8 `q` and its scale: one per block of `block` ([ceil(N/bn), ceil(K/bk)]), else a
    scalar or one per output row."""
    w = q.to(torch.float32)
    scale = scale.to(torch.float32)
    n, k = w.shape
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"a block-wise fp8 weight of shape {(n, k)} needs a weight_scale_inv of shape {want} "
                             f"for blocks of {block}, got {tuple(scale.shape)}")
        return w * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.numel() == n:
        return w * scale.reshape(n, 1)
    raise ValueError(f"an fp8 weight of shape {(n, k)} needs a scalar weight_scale or one per output row ({n}), got "
                     f"shape {tuple(scale.shape)}")


def quantize(w: torch.Tensor, block: tuple[int, int] | None = None, per_tensor: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weights, float32 scale) with w ~ dequantize(q, scale, block): amax / 448 per block, per tensor, or per
    output row (the default)."""
    w = w.to(torch.float32)
    n, k = w.shape
    if block is not None:
        bn, bk = block
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, device=w.device)
        padded[:n, :k] = w
        amax = padded.abs().view(padded.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(()) if per_tensor else scale


def quantized_online(name: str, w: torch.Tensor) -> torch.Tensor:
    """`--quantization fp8`: a linear weight rounded to fp8 with a scale per output row, back in its dtype (other
    tensors as they are)."""
    if not _quantizable(name, w):
        return w
    q, scale = quantize(w)
    return dequantize(q, scale, None).to(w.dtype)


def write_checkpoint(src: str, dst: str, block: tuple[int, int] | None = None, per_tensor: bool = False,
                     static_input: bool = False, compressed_tensors: bool = False, modelopt: str | None = None) -> str:
    """Our fp8 writer: the model at `src` (safetensors) with every linear weight in fp8 and its scales, a
    quantization_config saying how (Hugging Face's `fp8`, or llm-compressor's compressed-tensors layout), tokenizer
    and config files copied. `modelopt` "config" or "file": NVIDIA ModelOpt's FP8 layout (scalar weight and input
    scales, and each layer's k_proj.k_scale / v_proj.v_scale for an fp8 KV cache) declared in config.json or in
    hf_quant_config.json. Returns `dst`."""
    if modelopt is not None:
        per_tensor, static_input = True, True
    scale_name = "weight_scale_inv" if block and not compressed_tensors else "weight_scale"
    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(file, framework="pt") as f:  # (not the loader's checkpoint_files: the loader imports us)
            for name in f.keys():
                w = f.get_tensor(name)
                if not _quantizable(name, w):
                    out[name] = w
                    continue
                q, scale = quantize(w, block, per_tensor)
                out[name] = q
                out[name[: -len("weight")] + scale_name] = scale.reshape(1) if compressed_tensors and per_tensor \
                    else scale
                if static_input:
                    out[name[: -len("weight")] + "input_scale"] = torch.tensor(0.05)
                if modelopt is not None and name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                    kind = "k_scale" if "k_proj" in name else "v_scale"
                    out[name[: -len("weight")] + kind] = torch.tensor(0.0625)
    save_file(out, os.path.join(dst, "model.safetensors"))
    _copy_side_files(src, dst, ("model.safetensors.index.json",))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if modelopt is not None:
        fields = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "*.mlp.gate"]}
        if modelopt == "file":
            with open(os.path.join(dst, HF_QUANT_FILE), "w") as f:
                json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": fields}, f, indent=1)
        else:
            config["quantization_config"] = {"quant_method": "modelopt", **fields}
    elif compressed_tensors:
        weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
                   "strategy": "block" if block else "tensor" if per_tensor else "channel",
                   "block_structure": list(block) if block else None}
        acts = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": not static_input,
                "strategy": "tensor" if static_input else "token"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}
    else:
        config["quantization_config"] = {"quant_method": "fp8",
                                         "activation_scheme": "static" if static_input else "dynamic",
                                         **({"weight_block_size": list(block)} if block else {})}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst


def dequantized_checkpoint(src: str, dst: str, dtype: torch.dtype = torch.float32) -> str:
    """The float twin of the fp8 checkpoint at `src`: every fp8 weight times its scales, in `dtype`, no
    quantization_config. Returns `dst`."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    scheme = checkpoint_scheme(with_quant_file(config, src))
    config.pop("quantization_config", None)
    os.makedirs(dst, exist_ok=True)
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    out = {}
    for name, t in tensors.items():
        if scale_of(name):
            continue
        if t.dtype == FP8:
            stem = name[: -len("weight")]
            scale = tensors[stem + scheme.scale_name]
            t = dequantize(t, scale, scheme.block)
        out[name] = t.to(dtype)
    save_file(out, os.path.join(dst, "model.safetensors"))
    _copy_side_files(src, dst, ("config.json", HF_QUANT_FILE))
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst
