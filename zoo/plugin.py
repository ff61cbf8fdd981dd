"""Everything a plugin imports: a model, a data set or a checkpoint family, inside zoo or outside.

zoo's own models (`zoo.models`) and data sets (`zoo.data`) are plugins written against this
module alone, as a project's own would be:

    from zoo.plugin import loss_contract, logical_spec, partitioned, register_model

- Registering: `register_model` (a constructor whose keyword parameters are its config),
  `register_data` (a loader returning `Splits`), `register_family` / `register_families`
  (checkpoints of another library: a `Family` and its table of `Rule`s; the config keys it
  honours and those it lists as inert, besides `COMMON_INERT`; `COMMON_REFUSED`: the keys
  every Hugging Face config may carry that are refused at other values; `Combine`: tensors a
  quantized checkpoint stores in parts, such as MXFP4's, which `mxfp4_shape` and
  `dequantize_mxfp4` read).
- The loss contract: `loss(model, batch, rngs) -> (loss[B], {metric: value[B]})`, per example
  (`LossFn`), marked with the batch columns it reads by `loss_contract`; a `WEIGHT` entry among
  the metrics weights the examples (tokens per sequence), `MASK` is the column that marks
  an eval batch's padding rows, and `LOSS_MASK` the column that marks which of a sequence's
  next-token targets carry loss (a chat's replies); `SEGMENT_IDS` and `POSITIONS` the columns
  of packed rows, which a model takes when its class sets `PACKED_ROWS = True`, and
  `PAIR_SLOTS` the column that says which segments of packed preference pairs hold a pair;
  `real_inputs` marks the input positions that hold tokens. A model that adds a loss term of
  its own to any loss (a mixture of experts' router loss) implements `AuxiliaryLoss`, through
  which the preference and reward objectives call it.
- Sharding by logical axis names (`batch`, `embed`, `mlp`, `heads`, `vocab`, ...), which the
  run's rules map onto its mesh: `partitioned(init, axes)` annotates a param, `logical_spec`
  names an activation's axes, `unsplit_batch()` lifts the batch split for calls on a few
  examples; `repeated(make, count)` builds a stack of like layers (cloned in abstract builds).
- `TransposedLinear`: a dense layer holding its kernel (outputs..., inputs...), as PyTorch
  checkpoints do, so that loading one is a straight copy; LoRA adapts it as it does
  `nnx.Linear`; `outputs_first_product` its product alone (logits through a tied embedding
  table). `dense_dot_general`: the `dot_general` to give an `nnx.Linear` or
  `nnx.LinearGeneral`, so that its bfloat16 product on a CPU, backward pass included, takes
  XLA:CPU's bfloat16 path (`TransposedLinear` takes it itself). `widened_copies(weights)`
  and `reading_widened(weights, copies)`: a decoding loop's bfloat16 weights held in float32
  once where zoo's bfloat16 CPU kernel does not run, and its steps traced to multiply them.
- `attend(q, k, v, ...)`: attention, given what the layer knows of the call (causal, a sliding
  window, soft-capped logits, packed rows' segments, a key/value cache's mask, Dropout on the
  weights); it picks the kernel for the platform (cuDNN's, XLA's, zoo's CPU kernels, or written
  out).
- Evaluation hooks: `EvalReport` (what `on_eval` receives) and `image_grid`.
- `ZooError`: the one exception for bad input; raise it with a message that names the bad value
  and what would be valid.

Everything here is re-exported from the engine (`zoo.engine`), whose other modules are not part
of the plugin surface.
"""

from zoo.engine.errors import ZooError
from zoo.engine.kernels import (
    TransposedLinear,
    attend,
    outputs_first_product,
    reading_widened,
    widened_copies,
)
from zoo.engine.kernels import dot_general as dense_dot_general
from zoo.engine.pipeline import MASK, ExampleSource
from zoo.engine.registry import (
    COMMON_INERT,
    COMMON_REFUSED,
    LOSS_MASK,
    PAIR_SLOTS,
    POSITIONS,
    SEGMENT_IDS,
    WEIGHT,
    AuxiliaryLoss,
    Batch,
    Combine,
    Family,
    LossFn,
    OnEval,
    Rule,
    Splits,
    loss_contract,
    real_inputs,
    register_data,
    register_families,
    register_family,
    register_model,
)
from zoo.engine.report import EvalReport, ReplyPrompt, image_grid
from zoo.engine.sharding import logical_spec, partitioned, repeated, unsplit_batch
from zoo.engine.steps import construction_rngs
from zoo.engine.weights import dequantize_mxfp4, mxfp4_shape

__all__ = [
    "COMMON_INERT",
    "COMMON_REFUSED",
    "LOSS_MASK",
    "MASK",
    "PAIR_SLOTS",
    "POSITIONS",
    "SEGMENT_IDS",
    "WEIGHT",
    "AuxiliaryLoss",
    "Batch",
    "Combine",
    "EvalReport",
    "ExampleSource",
    "Family",
    "LossFn",
    "OnEval",
    "ReplyPrompt",
    "Rule",
    "Splits",
    "TransposedLinear",
    "ZooError",
    "attend",
    "construction_rngs",
    "dense_dot_general",
    "dequantize_mxfp4",
    "image_grid",
    "logical_spec",
    "loss_contract",
    "mxfp4_shape",
    "outputs_first_product",
    "partitioned",
    "reading_widened",
    "real_inputs",
    "register_data",
    "register_families",
    "register_family",
    "register_model",
    "repeated",
    "unsplit_batch",
    "widened_copies",
]
