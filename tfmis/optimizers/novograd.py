"""NovoGrad: SGD with momentum on gradients normalised by a per-layer (per-variable) second moment.

Ginsburg et al. 2019, "Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of
Deep Networks" (arXiv:1905.11286), written for the Keras 3 optimizer API (tensorflow-addons'
`NovoGrad` does not import under Keras 3).
"""

from __future__ import annotations

import math

import keras
from keras import ops

# Second-moment statistics of half-precision variables are kept in float32: ||g||² of a large layer
# overflows float16 long before the gradient itself does.
_HALF_PRECISION = ("float16", "bfloat16")


@keras.saving.register_keras_serializable(package="tfmis")
class Novograd(keras.optimizers.Optimizer):
    """NovoGrad optimizer (Ginsburg et al. 2019) for Keras 3.

    For each variable ("layer") w with gradient g_t, step t = 1, 2, ...:

        v_1 = ||g_1||²                                      (initialisation, no decay)
        v_t = β2 · v_{t-1} + (1 − β2) · ||g_t||²             (t > 1; one scalar per variable)
        u_t = g_t / (sqrt(v_t) + ε) + d · w_{t-1}             (d = weight_decay)
        m_t = β1 · m_{t-1} + c_t · u_t                        (c_t = 1, or 1 − β1 with grad_averaging)
        w_t = w_{t-1} − lr_t · m_t

    With `amsgrad=True`, sqrt(v_t) is replaced by sqrt(max(v_1, ..., v_t)).

    Which formulation, and why. The paper (Algorithm 1), tensorflow-addons' `NovoGrad` and MONAI's
    `Novograd` (from NVIDIA's OpenSeq2Seq/Jasper code) agree on the update above: the second moment is a
    scalar per variable initialised with the first squared gradient norm, epsilon is added to sqrt(v_t)
    (not inside the square root), and weight decay is "decoupled" in the paper's sense: d · w is added
    *after* the gradient is normalised, so it is not rescaled by 1/sqrt(v), but it does go through the
    momentum and is multiplied by the learning rate (it is not AdamW's direct w ← w − lr · d · w). With
    grad_averaging, (1 − β1) multiplies the whole u_t, weight-decay term included, as in both libraries.
    The references differ in two details, resolved here as follows:

    - First step with grad_averaging: this follows the paper's initialisation m_1 = u_1 (as
      tensorflow-addons does, which skips the (1 − β1) factor on the first step); MONAI applies
      (1 − β1) from the first step, which only shrinks the first updates by (1 − β1).
    - How "first step" is detected: per variable, as "v is still 0" (as MONAI does), not from the
      global `iterations` counter (as tensorflow-addons does). The two agree in ordinary training, but
      the per-variable test stays right when the first real update is not iteration 0: with
      `gradient_accumulation_steps`, when a variable only starts receiving gradients later, or after a
      loss-scaling skip. A variable whose gradients have all been exactly zero is still "uninitialised";
      its next nonzero gradient initialises it, which is what the paper's rule means for it.

    Defaults: β2 = 0.999 as tensorflow-addons; MONAI's `Novograd` defaults to β2 = 0.98, so pass
    `beta_2=0.98` to reproduce a MONAI recipe (with it, and without grad_averaging, the updates equal
    MONAI's: tests/test_optimizers.py checks this against MONAI's step written out in NumPy). ε = 1e-8
    as MONAI.

    The optimizer keeps one first-moment tensor per variable (like SGD with momentum) plus one scalar,
    half Adam's memory. Keras' own decoupled weight decay is *not* applied on top: `weight_decay` is
    folded into the moment as above, and `exclude_from_weight_decay(...)` (e.g. biases and norm
    scales) is honoured.

    Args:
        learning_rate: float, `keras.optimizers.schedules.LearningRateSchedule`, or callable.
        beta_1: decay of the first moment (momentum), in [0, 1).
        beta_2: decay of the per-variable second moment, in [0, 1).
        epsilon: added to sqrt(v_t) for numerical stability.
        weight_decay: d above, >= 0.
        grad_averaging: multiply the normalised gradient (and decay term) by (1 − β1) after the first
            step, making m an exponential moving average as in Adam.
        amsgrad: normalise by the running maximum of v_t (Reddi et al. 2018).
        name: optimizer name (prefix of its variables).
        **kwargs: standard Keras optimizer arguments: `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`.

    Example:
        >>> import keras
        >>> from tfmis.optimizers import Novograd
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=Novograd(learning_rate=1e-2, weight_decay=1e-3), loss="mse")
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 0.0,
        grad_averaging: bool = False,
        amsgrad: bool = False,
        name: str = "novograd",
        **kwargs,
    ):
        # `weight_decay` reaches the base class (so get_config/from_config and exclude_from_weight_decay
        # work) but the base class's decoupled decay is disabled in `_apply_weight_decay` below.
        # checked first, so a bad value is named before Keras builds anything (`not x >= 0` also refuses NaN)
        if isinstance(learning_rate, (int, float)) and not (learning_rate > 0.0 and math.isfinite(learning_rate)):
            raise ValueError(f"Novograd: learning_rate must be a finite number > 0, got {learning_rate}")
        if not 0.0 <= beta_1 < 1.0:
            raise ValueError(f"Novograd: beta_1 must be in [0, 1), got {beta_1}")
        if not 0.0 <= beta_2 < 1.0:
            raise ValueError(f"Novograd: beta_2 must be in [0, 1), got {beta_2}")
        if not (epsilon >= 0.0 and math.isfinite(epsilon)):
            raise ValueError(f"Novograd: epsilon must be a finite number >= 0, got {epsilon}")
        if weight_decay is not None and not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
            raise ValueError(f"Novograd: weight_decay must be a finite number >= 0, got {weight_decay}")
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, name=name, **kwargs)
        if weight_decay is None:
            self.weight_decay = weight_decay = 0.0
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.grad_averaging = bool(grad_averaging)
        self.amsgrad = bool(amsgrad)

    def build(self, var_list):
        """Creates, per variable, the first moment `m` (variable-shaped) and the scalar second moment
        `v` (plus its running maximum with amsgrad)."""
        if self.built:
            return
        super().build(var_list)
        self._first_moments = [self.add_variable_from_reference(var, name="first_moment") for var in var_list]
        self._second_moments = [self._add_scalar_slot(var, "second_moment") for var in var_list]
        self._max_second_moments = (
            [self._add_scalar_slot(var, "max_second_moment") for var in var_list] if self.amsgrad else []
        )

    def _add_scalar_slot(self, reference, name: str):
        """A float scalar optimizer variable named after, and (under tf.distribute) colocated with,
        `reference`."""
        if hasattr(reference, "path"):
            slot_name = f"{reference.path.replace('/', '_')}_{name}"
        else:
            slot_name = f"{str(reference.name).replace('/', '_').replace(':', '_')}_{name}"
        dtype = keras.backend.standardize_dtype(reference.dtype)
        dtype = "float32" if dtype in _HALF_PRECISION else dtype
        strategy = getattr(self, "_distribution_strategy", None)  # set by the TensorFlow backend only
        if strategy is None:
            return self.add_variable(shape=(), dtype=dtype, name=slot_name)
        colocate_with = reference.value if isinstance(reference, keras.Variable) else reference
        with strategy.extended.colocate_vars_with(colocate_with):
            return self.add_variable(shape=(), dtype=dtype, name=slot_name)

    def _apply_weight_decay(self, variables):
        # NovoGrad's weight decay enters the first moment in `update_step`; the base class would
        # additionally shrink the weights directly (AdamW style).
        return

    def update_step(self, gradient, variable, learning_rate):
        """One NovoGrad update of `variable` with `gradient` (called once per variable per step)."""
        gradient = _densify(gradient)
        index = self._get_variable_index(variable)
        first_moment = self._first_moments[index]
        second_moment = self._second_moments[index]
        var_dtype = variable.dtype
        stat_dtype = second_moment.dtype

        beta_1 = ops.cast(self.beta_1, var_dtype)
        beta_2 = ops.cast(self.beta_2, stat_dtype)
        lr = ops.cast(learning_rate, var_dtype)

        gradient_stat = ops.cast(gradient, stat_dtype)
        grad_sq_norm = ops.sum(ops.square(gradient_stat))
        is_first_step = ops.equal(second_moment, ops.zeros((), stat_dtype))
        new_second_moment = ops.where(
            is_first_step, grad_sq_norm, beta_2 * second_moment + (1.0 - beta_2) * grad_sq_norm
        )
        self.assign(second_moment, new_second_moment)
        normaliser = new_second_moment
        if self.amsgrad:
            max_second_moment = self._max_second_moments[index]
            normaliser = ops.maximum(max_second_moment, new_second_moment)
            self.assign(max_second_moment, normaliser)
        denominator = ops.sqrt(normaliser) + ops.cast(self.epsilon, stat_dtype)
        direction = ops.cast(gradient_stat / denominator, var_dtype)

        if self.weight_decay and self._use_weight_decay(variable):
            direction = direction + ops.cast(self.weight_decay, var_dtype) * variable
        if self.grad_averaging:
            scale = ops.where(is_first_step, ops.ones((), var_dtype), 1.0 - beta_1)
            direction = direction * ops.cast(scale, var_dtype)

        new_first_moment = beta_1 * first_moment + direction
        self.assign(first_moment, new_first_moment)
        self.assign_sub(variable, lr * new_first_moment)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "epsilon": self.epsilon,
                "grad_averaging": self.grad_averaging,
                "amsgrad": self.amsgrad,
            }
        )
        return config


def _densify(gradient):
    """Sparse gradients (tf.IndexedSlices, from embeddings/gathers) as dense tensors: the squared norm
    must sum duplicate indices, and the momentum of every row decays anyway."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(gradient, tf.IndexedSlices):
            return tf.convert_to_tensor(gradient)
    return gradient
