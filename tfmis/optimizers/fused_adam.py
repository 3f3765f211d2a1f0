"""Keras' Adam and AdamW with one fused TensorFlow kernel per variable and step.

Keras 3's TensorFlow optimizer writes Adam's update of each variable as about twenty small ops (the
step's bias corrections, the two moment updates, the weight update) plus five more for AdamW's weight
decay. For the demo's U-Net that is half of the training step's graph: it lengthens the step's tracing
and the graph optimisation before the first step, a cost every run's first epoch pays, while its
steady-state cost is within noise (docs/benchmarks.md, "First epoch, precision and other costs"). Here
each variable's update is `ResourceApplyAdam`, the kernel `tf.compat.v1`'s Adam used, and the scalars
(learning rate, bias corrections, weight-decay factor) are computed once per step for all variables. The
arithmetic is Keras' (Kingma & Ba's Adam with ε added to √v̂ in the step-size form, and Loshchilov &
Hutter's decoupled decay `w ← w − lr · wd · w` before it); AMSGrad, sparse gradients and other backends
fall back to Keras' own ops.
"""

from __future__ import annotations

import keras
import tensorflow as tf


class _FusedAdamUpdate:
    """The update of `keras.optimizers.Adam`/`AdamW` with `ResourceApplyAdam` (mixed in before them)."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        self._step_scalars = {}  # per dtype, for this step's trace: one set for all variables
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._step_scalars = None

    def _scalars(self, learning_rate, dtype):
        cache = getattr(self, "_step_scalars", None)
        if cache is not None and dtype in cache:
            return cache[dtype]
        local_step = tf.cast(self.iterations + 1, dtype)
        scalars = (
            tf.cast(learning_rate, dtype),
            tf.pow(tf.cast(self.beta_1, dtype), local_step),
            tf.pow(tf.cast(self.beta_2, dtype), local_step),
            tf.cast(self.beta_1, dtype),
            tf.cast(self.beta_2, dtype),
            tf.cast(self.epsilon, dtype),
        )
        if cache is not None:
            cache[dtype] = scalars
        return scalars

    def update_step(self, gradient, variable, learning_rate):
        if (
            self.amsgrad
            or keras.backend.backend() != "tensorflow"
            or isinstance(gradient, tf.IndexedSlices)
            or not hasattr(variable, "handle")
        ):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index].value, self._velocities[index].value
        lr, beta_1_power, beta_2_power, beta_1, beta_2, epsilon = self._scalars(learning_rate, variable.dtype)
        # m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²; w ← w − lr·√(1−β2ᵗ)/(1−β1ᵗ) · m/(√v + ε)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=m.handle,
            v=v.handle,
            beta1_power=beta_1_power,
            beta2_power=beta_2_power,
            lr=lr,
            beta1=beta_1,
            beta2=beta_2,
            epsilon=epsilon,
            grad=tf.cast(gradient, variable.dtype),
            use_locking=False,
            use_nesterov=False,
        )

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None or keras.backend.backend() != "tensorflow":
            return super()._apply_weight_decay(variables)
        factors = {}

        def decay(variable):  # w ← w − lr · wd · w, the factor computed once per dtype
            if variable.dtype not in factors:
                factors[variable.dtype] = tf.cast(self.learning_rate, variable.dtype) * tf.cast(
                    self.weight_decay, variable.dtype
                )
            variable.assign_sub(variable * factors[variable.dtype])

        def apply_all(distribution, variables):
            for variable in variables:
                if self._use_weight_decay(variable):
                    variable = variable.value if isinstance(variable, keras.Variable) else variable
                    distribution.extended.update(variable, decay, group=False)

        tf.__internal__.distribute.interim.maybe_merge_call(apply_all, self._distribution_strategy, variables)


@keras.saving.register_keras_serializable(package="tfmis")
class FusedAdam(_FusedAdamUpdate, keras.optimizers.Adam):
    """`keras.optimizers.Adam` (with decoupled `weight_decay` if set), fused: see the module docstring.

    Example:
        >>> optimizer = FusedAdam(learning_rate=1e-3)
        >>> w = keras.Variable([1.0, -2.0])
        >>> optimizer.apply([tf.constant([0.5, 0.5])], [w])
        >>> [round(float(x), 4) for x in w.numpy()]
        [0.999, -2.001]
    """


@keras.saving.register_keras_serializable(package="tfmis")
class FusedAdamW(_FusedAdamUpdate, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW`, fused: see the module docstring."""
