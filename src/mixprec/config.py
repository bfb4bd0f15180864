"""The job config: one TOML table per component, one frozen dataclass per table.

Precedence: command line (`--section.key value`) > TOML file (`--config`) > defaults.
Each field's docstring is its documentation in `mixprec train --help` and docs/cli.md.
"""

import ast
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path

from mixprec.errors import UserError
from mixprec.errors import check_value as _check
from mixprec.data.tokenizer import tokenizer_path
from mixprec.plan.config import PlanConfig
from mixprec.precision.fp8_config import FP8Config
from mixprec.precision.scaling_config import LossScaleConfig
from mixprec.stability.config import StabilityConfig


@dataclass(frozen=True)
class Job:
    dump_folder: str = "outputs/run"
    """Run folder: config, metrics, checkpoints, plots and summary.json are written here."""
    description: str = ""
    """Free text kept with the run."""


@dataclass(frozen=True)
class Model:
    flavor: str = "small"
    """Model shape: debug (tests, seconds on a CPU), small (~30M parameters), 1B, 8B, 70B (Llama-3 shapes); mixtures of experts: moe-debug, moe-small (56M parameters, 23M active), moe-16B (DeepSeek-V2-Lite's shape)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 keeps the flavor's."""
    tie_embeddings: str = "flavor"
    """Share the embedding and output weights: true, false, or flavor (the flavor's choice)."""
    attention: str = "auto"
    """eager (explicit FP32 softmax, observable by the audit), sdpa (PyTorch's fused scaled_dot_product_attention), or auto: sdpa on CUDA, eager on a CPU (where the fused BF16 kernel is slower)."""
    loss: str = "auto"
    """full (the micro-batch's FP32 logits at once), chunked (output projection and loss a chunk of tokens at a time, gradients computed in the same pass: the full logits never exist), or auto: chunked when a micro-batch's FP32 logits exceed 256 MiB, or, with the loss compiled on a GPU, 1/16 of its memory (there the compiled full loss was measured faster and lighter)."""
    balance: str = "bias"
    """How an MoE flavor balances its experts' load: bias (DeepSeek-V3's auxiliary-loss-free: a per-expert bias on the routing scores, moved after each step towards the under-loaded experts) or aux (the auxiliary loss, added to the training loss)."""
    hf_config: str = ""
    """A Hugging Face causal LM's config.json (or its folder) to train instead of mixprec's Llama: randomly initialised, nothing downloaded (needs mixprec[hf]); FSDP2, activation checkpointing and compile act on each decoder layer; no tensor parallel or chunked loss yet. Empty: the flavor."""

    def __post_init__(self):
        _check(self.n_kv_heads >= 0, "model.n_kv_heads", self.n_kv_heads, "0 (flavor's) or a divisor of n_heads")
        _check(self.tie_embeddings in ("true", "false", "flavor"), "model.tie_embeddings",
               self.tie_embeddings, "true, false, flavor")
        _check(self.attention in ("auto", "eager", "sdpa"), "model.attention", self.attention, "auto, eager, sdpa")
        _check(self.loss in ("auto", "chunked", "full"), "model.loss", self.loss, "auto, chunked, full")
        _check(self.balance in ("bias", "aux"), "model.balance", self.balance, "bias, aux")


@dataclass(frozen=True)
class Data:
    source: str = "stdlib"
    """Training text: stdlib (this Python's standard-library sources, no download), a text file or folder (read and
    tokenized at start), or a folder of token shards written by mixprec prepare (read a window at a time)."""
    tokenizer: str = "byte"
    """byte (UTF-8 bytes, vocabulary 256), bpe (trained on the training split, cached in the run folder), or a Hugging Face tokenizer.json (or the model folder that holds it: a pretrained model's own tokens)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the BPE tokenizer."""
    val_fraction: float = 0.05
    """Share of the files (or of the text, for one file) held out for validation."""

    def __post_init__(self):
        _check(self.tokenizer in ("byte", "bpe") or tokenizer_path(self.tokenizer).is_file(), "data.tokenizer",
               self.tokenizer, "byte, bpe, or a tokenizer.json file (or a folder holding one)")
        _check(self.bpe_vocab_size >= 260, "data.bpe_vocab_size", self.bpe_vocab_size, "an integer >= 260")
        _check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "a number in (0, 1)")
        _check(bool(self.source.strip()), "data.source", self.source, "stdlib, or a path to a text file or folder")


@dataclass(frozen=True)
class Training:
    steps: int = 100
    """Optimizer steps to train."""
    seq_len: int = 256
    """Tokens per sequence."""
    local_batch_size: int = 4
    """Sequences per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; a multiple of local_batch_size x data-parallel ranks (the rest is gradient accumulation). -1: no accumulation."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 10
    """Linear warm-up steps, then cosine decay to lr * min_lr_factor."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norm weights)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon. With float16 optimizer states (fp16-true) use 1e-4: 1e-8 is 0 in float16."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 0
    """Seed for weights and data order."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    eval_interval: int = 50
    """Validate every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Validation micro-batches per evaluation."""
    early_stopping_patience: int = 0
    """Stop after this many evaluations without a lower validation loss; 0 disables."""
    dtype: str = ""
    """TorchTitan's training.dtype: bfloat16 stores parameters and optimizer states in bfloat16 (bf16-true)."""
    mixed_precision_param: str = ""
    """TorchTitan's compute dtype (bfloat16 or float32); same as precision.param_dtype."""
    mixed_precision_reduce: str = ""
    """TorchTitan's reduction dtype; same as precision.reduce_dtype."""

    def __post_init__(self):
        for name in ("steps", "seq_len", "local_batch_size", "eval_batches"):
            _check(getattr(self, name) > 0, f"training.{name}", getattr(self, name), "a positive integer")
        for name in ("warmup_steps", "eval_interval", "early_stopping_patience"):
            _check(getattr(self, name) >= 0, f"training.{name}", getattr(self, name), "an integer >= 0")
        gbs, lbs = self.global_batch_size, self.local_batch_size
        _check(gbs == -1 or (gbs > 0 and gbs % lbs == 0), "training.global_batch_size", gbs,
               f"-1 or a positive multiple of local_batch_size ({lbs})")
        _check(0 < self.lr < math.inf, "training.lr", self.lr, "a positive finite number")
        _check(0 < self.eps < math.inf, "training.eps", self.eps, "a positive finite number (1e-8; 1e-4 for float16 "
               "optimizer states)")
        _check(0 <= self.min_lr_factor <= 1, "training.min_lr_factor", self.min_lr_factor, "a number in [0, 1]")
        _check(0 <= self.weight_decay < math.inf, "training.weight_decay", self.weight_decay, "a finite number >= 0")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"training.{name}", getattr(self, name), "a number in [0, 1)")
        _check(0 <= self.max_norm < math.inf, "training.max_norm", self.max_norm, "a finite number >= 0 (0 disables)")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
               "training.device", self.device, "auto, cpu, cuda, cuda:N")


@dataclass(frozen=True)
class Precision:
    preset: str = ""
    """fp32, bf16-mixed, bf16-true, bf16-kahan, bf16-sr, bf16-mixed-8bit, bf16-kahan-8bit, fp16-mixed, fp16-master, bf16-master, fp16-true, fp8-tensorwise, fp8-delayed, fp8-rowwise, fp8-blockwise, mxfp8, nvfp4, mxfp4, or an alias (32-true, no, bf16, 16-mixed, fp16, 16-true, O0-O3). Empty: built from the dtype keys, which default to bf16-mixed."""
    param_dtype: str = ""
    """Compute dtype (float32, bfloat16 or float16); empty: the preset's."""
    reduce_dtype: str = ""
    """Gradient reduction dtype across ranks; empty: float32."""
    storage_dtype: str = ""
    """Dtype of stored parameters, gradients and optimizer states; empty: the preset's."""
    emulate_matmul: str = "auto"
    """bfloat16/float16 matmuls as float32 GEMMs on the rounded operands: true, false, or auto (when the device has no native kernel)."""
    override: tuple[str, ...] = ()
    """Per-module compute, ordered rules PATTERN=FORMAT (fnmatch on module names; the first match decides): FORMAT float32 or bfloat16 (bf16 modes: "keep this layer in high precision") or an FP8 recipe (fp8-rowwise, ...). In TOML also [[precision.override]] tables with modules and compute keys."""
    plan: str = ""
    """A plan file written by `mixprec plan`: each layer it names computes in the format it chose (rules after precision.override's, so the user's own rules win). Empty: none."""
    optimizer_states: str = ""
    """AdamW's moments: fp32, bf16, fp16, fp8 (e4m3 with an FP32 scale per block) or 8bit (block-wise dynamic code, as bitsandbytes'); empty: the preset's (bf16-mixed: fp32; fp8-blockwise: bf16; bf16-mixed-8bit: 8bit)."""
    optimizer_state_block: int = 0
    """Elements per block scale of fp8/8bit moments, along a tensor's last dimension; 0: 256."""
    optimizer_state_min_size: int = -1
    """Tensors with fewer elements keep float32 moments under fp8/8bit; -1: 4096."""
    optimizer_state_embeddings: bool = False
    """Embeddings' moments in fp8/8bit too (default: float32, as bitsandbytes advises)."""
    tf32: bool = False
    """float32 matmuls on CUDA as TF32 (10-bit mantissa inputs, float32 accumulation; torch.set_float32_matmul_precision("high")). Off: true float32, as in Lightning's 32-true."""

    def __post_init__(self):
        _check(self.emulate_matmul in ("auto", "true", "false"), "precision.emulate_matmul", self.emulate_matmul,
               "auto, true, false")
        _check(self.optimizer_state_block >= 0, "precision.optimizer_state_block", self.optimizer_state_block,
               "a positive integer (0: 256)")
        _check(self.optimizer_state_min_size >= -1, "precision.optimizer_state_min_size",
               self.optimizer_state_min_size, "an integer >= 0 (-1: 4096)")

    def states(self, preset_states=None):
        """The StateFormat the optimizer_state keys ask for on top of the preset's (`preset_states`), or
        None where no key is set."""
        from mixprec.optim.state_formats import StateFormat

        if not (self.optimizer_states or self.optimizer_state_block or self.optimizer_state_min_size >= 0
                or self.optimizer_state_embeddings):
            return None
        base = preset_states or StateFormat("fp32")
        return StateFormat(self.optimizer_states or base.name, self.optimizer_state_block or base.block_size,
                           base.min_size if self.optimizer_state_min_size < 0 else self.optimizer_state_min_size,
                           self.optimizer_state_embeddings or base.embeddings)

    @property
    def emulate(self) -> bool | None:
        return None if self.emulate_matmul == "auto" else self.emulate_matmul == "true"


@dataclass(frozen=True)
class Checkpoint:
    enable: bool = True
    """Write checkpoints, and resume from the run folder's latest one when it has one."""
    folder: str = "checkpoint"
    """Checkpoint folder inside the run folder."""
    convert_optimizer_states: bool = False
    """Resuming a checkpoint whose AdamW moments are in another format (precision.optimizer_states): convert them (dequantize, store in this run's format) instead of refusing."""
    interval: int = 100
    """Save every this many steps (and at the end)."""
    keep_latest_k: int = 2
    """Keep this many newest checkpoints; 0 keeps all."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1: the latest, if any."""
    initial_load: str = ""
    """Weights to start from when the run folder has no checkpoint yet (TorchTitan's initial_load_path): a Hugging Face folder (config.json and safetensors, sharded or not; a Llama becomes mixprec's own Llama, shaped by its config.json, unless model.hf_config names the architecture) or a mixprec checkpoint (step-N.pt or a step-N folder; its weights only). Empty: random initialisation."""

    def __post_init__(self):
        _check(self.interval > 0, "checkpoint.interval", self.interval, "a positive integer")
        _check(self.keep_latest_k >= 0, "checkpoint.keep_latest_k", self.keep_latest_k, "an integer >= 0")
        _check(self.load_step >= -1, "checkpoint.load_step", self.load_step, "-1 (latest) or a step number")


@dataclass(frozen=True)
class Metrics:
    log_freq: int = 10
    """Print a log line every this many steps."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events to the run folder (needs the tensorboard package)."""
    plot: bool = True
    """Write loss_curve.png at the end (needs matplotlib)."""
    progress_bar: bool = True
    """Show a progress bar on a terminal."""

    def __post_init__(self):
        _check(self.log_freq > 0, "metrics.log_freq", self.log_freq, "a positive integer")


@dataclass(frozen=True)
class Compare:
    max_loss_diff: float = 0.05
    """mixprec compare: a preset fails when its final validation loss is this much (relative) above the baseline's."""
    max_perplexity_diff: float = 0.03
    """mixprec compare: ... or its validation perplexity this much (relative) above the baseline's."""
    max_overflow_rate: float = 0.10
    """mixprec compare: ... or more than this share of its steps overflowed."""

    def __post_init__(self):
        for name in ("max_loss_diff", "max_perplexity_diff", "max_overflow_rate"):
            _check(getattr(self, name) >= 0, f"compare.{name}", getattr(self, name), "a number >= 0")


@dataclass(frozen=True)
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Data-parallel replicas (DDP; with sharding too, HSDP)."""
    data_parallel_shard_degree: int = -1
    """FSDP2 shards; -1: the processes the other degrees leave."""
    tensor_parallel_degree: int = 1
    """Tensor parallelism: attention heads and MLP width split over this many ranks (DTensor)."""
    pipeline_parallel_degree: int = 1
    """Pipeline parallelism is out of scope: 1."""
    fsdp_reshard_after_forward: str = "default"
    """Free the all-gathered parameters after forward: default (yes, but not the root), always, never."""
    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2's CPUOffloadPolicy)."""
    lowp_all_gather: bool = True
    """FSDP2 all-gathers the weights of FP8 and microscaled Linear layers in their own format with their scales (1 byte an element, ~0.56 for FP4) instead of bfloat16; a layer where that cannot hold gathers bfloat16, logged with the reason."""
    expert_parallel_degree: int = 1
    """Expert parallelism for mixprec's mixture-of-experts flavors: each rank of an expert-parallel group of this many ranks holds n_experts / this many experts, and the tokens routed to another rank's experts travel there and back by all-to-all (torch.distributed); the ranks outside a group shard its experts' weights with FSDP2. Divides n_experts and data_parallel_shard_degree."""
    expert_dispatch: str = "base"
    """What the expert-parallel dispatch sends: base (the tokens in the activations' dtype) or fp8 (e4m3 with float32 scales, about half of bfloat16's bytes: cast as row- and block-wise experts cast their input, which take them as they arrive; else a power-of-two scale per token and 128-element block, cast again by the experts). The combine travels in the activations' dtype."""
    timeout_s: float = 300.0
    """Under torchrun, the longest wait of the process group (forming it, a collective, a store barrier) before the run ends with one line: a lost rank never hangs a job."""

    def __post_init__(self):
        _check(self.data_parallel_replicate_degree >= 1, "parallelism.data_parallel_replicate_degree",
               self.data_parallel_replicate_degree, "a positive integer")
        _check(self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
               "parallelism.data_parallel_shard_degree", self.data_parallel_shard_degree, "-1 or a positive integer")
        _check(self.pipeline_parallel_degree == 1, "parallelism.pipeline_parallel_degree",
               self.pipeline_parallel_degree, "1 (pipeline parallelism is out of scope)")
        _check(math.isfinite(self.timeout_s) and self.timeout_s > 0, "parallelism.timeout_s", self.timeout_s,
               "a number of seconds > 0")
        _check(self.expert_parallel_degree >= 1, "parallelism.expert_parallel_degree", self.expert_parallel_degree,
               "a positive integer")
        _check(self.expert_dispatch in ("base", "fp8"), "parallelism.expert_dispatch", self.expert_dispatch,
               "base, fp8")
        _check(self.fsdp_reshard_after_forward in ("default", "always", "never"),
               "parallelism.fsdp_reshard_after_forward", self.fsdp_reshard_after_forward, "default, always, never")


COMPILE_COMPONENTS = ("model", "loss")


@dataclass(frozen=True)
class Compile:
    enable: bool = False
    """torch.compile the components below (Inductor). On a CPU that emulates bfloat16/float16 matmuls the emulation cannot be traced: those runs stay eager, with a log line saying so."""
    components: tuple[str, ...] = COMPILE_COMPONENTS
    """What to compile: model (each transformer block on its own, as TorchTitan does) and loss (the final norm's output projection and the loss)."""

    def __post_init__(self):
        _check(bool(self.components) and set(self.components) <= set(COMPILE_COMPONENTS), "compile.components",
               list(self.components), "a non-empty list of model, loss")


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: str = "none"
    """none; selective (every other transformer block keeps only its input and recomputes the rest in backward); full (every block)."""

    def __post_init__(self):
        _check(self.mode in ("none", "selective", "full"), "activation_checkpoint.mode", self.mode,
               "none, selective, full")


TABLES = {"job": Job, "model": Model, "data": Data, "training": Training,
          "precision": Precision, "fp8": FP8Config, "loss_scale": LossScaleConfig, "parallelism": Parallelism,
          "activation_checkpoint": ActivationCheckpoint, "compile": Compile,
          "checkpoint": Checkpoint, "metrics": Metrics, "stability": StabilityConfig, "compare": Compare,
          "plan": PlanConfig}


@dataclass(frozen=True)
class Config:
    job: Job
    model: Model
    data: Data
    training: Training
    precision: Precision
    fp8: FP8Config
    loss_scale: LossScaleConfig
    parallelism: Parallelism
    activation_checkpoint: ActivationCheckpoint
    compile: Compile
    checkpoint: Checkpoint
    metrics: Metrics
    stability: StabilityConfig
    compare: Compare
    plan: PlanConfig


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


def field_types(cls) -> dict[str, type]:
    """Each field's type (resolved, also where annotations are strings)."""
    return typing.get_type_hints(cls)


def _convert(table: str, name: str, kind: type, value):
    """A TOML or command-line value converted to the field's type."""
    key = f"{table}.{name}"
    if kind == tuple[str, ...]:  # a TOML array, or "a,b" on the command line
        items = value.split(",") if isinstance(value, str) else value
        if key == "precision.override" and isinstance(items, list):  # [[precision.override]] tables
            items = [f"{i.get('modules', '')}={i.get('compute', '')}" if isinstance(i, dict) and set(i) <= {
                "modules", "compute"} else i for i in items]
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise UserError(f"{key}: bad value {value!r}; accepted: a list of strings (a,b on the command line)")
        return tuple(i.strip() for i in items if i.strip())
    if isinstance(value, bool) and kind is str:  # a TOML true/false for a true/false/empty option
        value = "true" if value else "false"
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                value = {"true": True, "false": False, "1": True, "0": False}[text]
            else:
                value = kind(text)
        except (KeyError, ValueError):
            accepted = {bool: "true or false", int: "an integer", float: "a number"}[kind]
            raise UserError(f"{key}: bad value {value!r}; accepted: {accepted}") from None
    if kind is float and type(value) is int:
        value = float(value)
    if kind is float and math.isnan(value):
        raise UserError(f"{key}: bad value {value!r}; accepted: a number (not NaN)")
    if type(value) is not kind:
        raise UserError(f"{key}: bad value {value!r}; accepted: a {kind.__name__}")
    return value


def load_config(path: str | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Defaults, then the TOML file, then `overrides` ({"section.key": "value"})."""
    raw: dict[str, dict] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"--config: no such file {path!r}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
            raise UserError(f"--config: {path} is not valid TOML ({e})") from None
    for key, value in (overrides or {}).items():
        table, _, name = key.partition(".")
        raw.setdefault(table, {})[name] = value
    sections = {}
    for table, values in raw.items():
        if table not in TABLES:
            raise UserError(f"unknown config table [{table}]; accepted: {', '.join(TABLES)}")
        if not isinstance(values, dict):
            raise UserError(f"config: {table} must be a table; accepted tables: {', '.join(TABLES)}")
    for table, cls in TABLES.items():
        known = field_types(cls)
        values = raw.get(table, {})
        for key in values:
            if key not in known:
                raise UserError(f"unknown config key {table}.{key}; accepted: {', '.join(known)}")
        sections[table] = cls(**{k: _convert(table, k, known[k], v) for k, v in values.items()})
    return Config(**sections)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: Config) -> str:
    """The resolved config as TOML that `--config` reads back."""
    lines = []
    for table in TABLES:
        lines.append(f"[{table}]")
        for f in fields(TABLES[table]):
            value = getattr(getattr(config, table), f.name)
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = _quote(value)
            elif isinstance(value, tuple):
                text = "[" + ", ".join(map(_quote, value)) + "]"
            else:
                text = repr(value)
            lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)
