"""Tests for the 3D U-Net: real Keras models, real gradients, tiny filters and patches."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.networks import ConvNormAct, ResidualUnit, UNetConfig, build_unet, check_patch_size
from tfmis.networks.blocks import InstanceNormalization, UpBlock, full_resolution_upsample_filters

TINY = dict(filters=(4, 8, 16), strides=(1, 2, 2))  # patch sides must be multiples of 4


def random_images(shape, channels=2, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(shape[0], *shape[1:], channels)).astype("float32")


def copy_state(source: keras.Model, target: keras.Model) -> None:
    """Same weights *and* same non-trainable state (moving stats, dropout seed states)."""
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src)


def gradients(model: keras.Model, images: np.ndarray, use_tf_function: bool):
    def loss_and_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(images, training=True)))
        return loss, tape.gradient(loss, model.trainable_variables)

    return (tf.function(loss_and_grads) if use_tf_function else loss_and_grads)()


@pytest.fixture
def mixed_policy(request):
    """Sets a global dtype policy for one test and always restores float32."""
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------------------- shapes


@pytest.mark.parametrize("patch", [(16, 16, 16), (48, 64, 32), (8, 12, 20)])
def test_output_shape_matches_patch_and_classes(patch):
    model = build_unet(in_channels=2, num_classes=5, **TINY)
    logits = model(random_images((1, *patch)))
    assert tuple(logits.shape) == (1, *patch, 5)
    assert logits.dtype == "float32"


def test_anisotropic_strides_keep_shape():
    strides = (1, (2, 2, 1), 2)  # e.g. thick slices: keep the last axis at full resolution once
    model = build_unet(1, 3, filters=(4, 8, 16), strides=strides, num_res_units=1)
    assert check_patch_size((16, 16, 6), strides) == (4, 4, 2)
    assert tuple(model(random_images((2, 16, 16, 6), channels=1)).shape) == (2, 16, 16, 6, 3)


def test_default_levels_downsample_by_their_stride():
    model = build_unet(2, 4)
    names = [layer.name for layer in model.layers]
    assert names[1:6] == ["encoder0", "encoder1", "encoder2", "encoder3", "bottleneck"]
    assert model.get_layer("bottleneck").output.shape[-1] == 256
    assert model.get_layer("decoder0").output.shape[-1] == 16
    assert model.input_shape == (None, None, None, None, 2)


# ----------------------------------------------------------------- patch sizes


def test_check_patch_size_accepts_multiples_and_names_divisor_on_error():
    assert check_patch_size(64, (1, 2, 2, 2, 2)) == (16, 16, 16)
    assert check_patch_size((48, 64, 32), (1, 2, 2, 2, 2)) == (16, 16, 16)
    with pytest.raises(ValueError) as error:
        check_patch_size((48, 64, 30), (1, 2, 2, 2, 2))
    message = str(error.value)
    assert "(48, 64, 30)" in message and "(16, 16, 16)" in message and "30 -> 32" in message
    with pytest.raises(ValueError, match="3 ints"):
        check_patch_size((48, 64), (1, 2))


def test_bad_patch_fails_with_clear_error_at_call_time():
    model = build_unet(2, 2, **TINY)
    with pytest.raises(ValueError, match="check_patch_size"):
        model(random_images((1, 16, 16, 10)))


# -------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("mixed_policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_mixed_precision_logits_are_float32_and_convs_half(mixed_policy):
    half = mixed_policy.removeprefix("mixed_")
    model = build_unet(2, 3, **TINY)
    first_conv = model.get_layer("encoder0").units[0].conv
    assert first_conv.compute_dtype == half and first_conv.variable_dtype == "float32"
    assert model.get_layer("head").compute_dtype == half
    assert model.get_layer("encoder0").output.dtype == half
    logits = model(random_images((1, 8, 8, 8)), training=True)
    assert logits.dtype == "float32"
    assert np.isfinite(keras.ops.convert_to_numpy(logits)).all()
    assert keras.mixed_precision.global_policy().name == mixed_policy


def test_policy_is_float32_outside_mixed_tests():
    assert keras.mixed_precision.global_policy().name == "float32"


# ------------------------------------------------------------------- training


@pytest.mark.parametrize("norm", ["batch", "instance", "group"])
def test_each_norm_trains_loss_decreases(norm):
    keras.utils.set_random_seed(0)
    model = build_unet(2, 2, filters=(4, 8), strides=(1, 2), norm=norm, norm_groups=2, num_res_units=1)
    images = random_images((2, 8, 8, 8))
    labels = (images[..., 0] > 0).astype("int32")  # trivial: class = sign of channel 0
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(1e-2)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    losses = [float(train_step()) for _ in range(6)]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("mixed_policy", ["float32", "mixed_float16"], indirect=True)
def test_instance_normalization_equals_group_normalization_with_a_group_per_channel_and_loads_its_weights(
    mixed_policy, tmp_path, monkeypatch
):
    """A residual unit with norm "instance" as built before `InstanceNormalization` existed (Keras'
    GroupNormalization with groups = channels) saves weights that load into today's by name, and both give the
    same outputs (float32 round-off; float16 outputs under mixed precision to one float16 step)."""
    from tfmis.networks import blocks

    images = random_images((2, 6, 5, 4), channels=3) * 5 + 2
    inputs = keras.Input((None, None, None, 3))

    def unit():
        return keras.Model(inputs, ResidualUnit(4, norm="instance", subunits=2, name="unit")(inputs))

    instance = unit()
    with monkeypatch.context() as m:
        m.setattr(blocks, "InstanceNormalization", lambda **kw: keras.layers.GroupNormalization(**kw))
        group = unit()
    norms = [l for l in group.get_layer("unit")._flatten_layers() if isinstance(l, keras.layers.GroupNormalization)]
    assert {type(l) for l in norms} == {keras.layers.GroupNormalization} and len(norms) == 2
    rng = np.random.default_rng(1)
    for layer in norms:
        layer.gamma.assign(rng.uniform(0.5, 2, 4))
        layer.beta.assign(rng.normal(size=4))
    group.save_weights(tmp_path / "group.weights.h5")
    instance.load_weights(tmp_path / "group.weights.h5")
    expected, got = (np.asarray(m(images), np.float32) for m in (group, instance))
    tolerance = 1e-6 if mixed_policy == "float32" else 4e-3  # float16: one step at |x| ≈ 4
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)
    assert np.abs(expected).max() > 0.5
    with pytest.raises(ValueError, match="one group per channel, got groups=1"):
        keras.Model(inputs, InstanceNormalization(groups=1, name="bad")(inputs))


def test_residual_and_plain_blocks():
    residual = build_unet(2, 3, num_res_units=2, **TINY)
    plain = build_unet(2, 3, num_res_units=0, **TINY)
    assert isinstance(residual.get_layer("encoder1"), ResidualUnit)
    assert len(residual.get_layer("encoder1").units) == 2
    assert residual.get_layer("encoder1").projection is not None  # strided: needs a residual conv
    assert residual.get_layer("bottleneck").projection is not None  # 8 -> 16 channels
    assert isinstance(plain.get_layer("encoder1"), ConvNormAct)
    assert isinstance(plain.get_layer("decoder0"), UpBlock)
    assert isinstance(plain.get_layer("decoder0").fuse, ConvNormAct)
    assert plain.count_params() < residual.count_params()
    images = random_images((1, 8, 8, 8))
    assert residual(images).shape == plain(images).shape == (1, 8, 8, 8, 3)


def test_dropout_only_active_in_training():
    model = build_unet(2, 3, dropout=0.5, **TINY)
    images = random_images((1, 8, 8, 8))
    inference = [keras.ops.convert_to_numpy(model(images, training=False)) for _ in range(2)]
    training = [keras.ops.convert_to_numpy(model(images, training=True)) for _ in range(2)]
    np.testing.assert_array_equal(inference[0], inference[1])
    assert not np.allclose(training[0], training[1])
    assert not np.allclose(training[0], inference[0])


# --------------------------------------------------------------- save / config


def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    model = build_unet(2, 3, norm="batch", dropout=0.2, recompute=True, activation="leaky_relu", **TINY)
    path = tmp_path / "unet.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    images = random_images((1, 8, 12, 16))
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(images)), keras.ops.convert_to_numpy(restored(images))
    )
    block = restored.get_layer("encoder1")
    assert block.recompute and block.norm == "batch" and block.dropout == 0.2
    assert block.activation == "leaky_relu"


def test_config_dict_round_trip_and_validation():
    config = UNetConfig.from_dict({"in_channels": 1, "num_classes": 2, "filters": [8, 16], "strides": [1, 2]})
    assert UNetConfig.from_dict(config.to_dict()) == config
    assert config.patch_divisor == (2, 2, 2)
    assert config.build().count_params() == build_unet(1, 2, filters=(8, 16), strides=(1, 2)).count_params()
    with pytest.raises(ValueError, match="unknown U-Net config keys"):
        UNetConfig.from_dict({"in_channels": 1, "num_classes": 2, "channels": (8, 16)})
    with pytest.raises(ValueError, match="one entry per level"):
        UNetConfig(1, 2, filters=(8, 16, 32), strides=(1, 2))
    with pytest.raises(ValueError, match="norm_groups"):
        UNetConfig(1, 2, filters=(4, 8), strides=(1, 2), norm="group", norm_groups=8)
    with pytest.raises(ValueError, match="norm must be"):
        UNetConfig(1, 2, norm="layer")


# ------------------------------------------------------------------- recompute


@pytest.mark.parametrize("use_tf_function", [False, True], ids=["eager", "tf_function"])
def test_recompute_gradients_equal_plain_gradients(use_tf_function):
    # batch norm + dropout: the stateful layers a naive recompute gets wrong
    options = dict(norm="batch", dropout=0.3, **TINY)
    plain = build_unet(2, 3, **options)
    recomputed = build_unet(2, 3, recompute=True, **options)
    copy_state(plain, recomputed)
    images = random_images((2, 8, 8, 8))

    plain_loss, plain_grads = gradients(plain, images, use_tf_function)
    recomputed_loss, recomputed_grads = gradients(recomputed, images, use_tf_function)

    np.testing.assert_allclose(float(recomputed_loss), float(plain_loss), rtol=1e-6)
    for variable, expected, actual in zip(plain.trainable_variables, plain_grads, recomputed_grads):
        assert actual is not None, variable.path
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6, err_msg=variable.path)
    # moving statistics updated once and dropout seeds advanced once, exactly as without recompute
    for expected, actual in zip(plain.non_trainable_variables, recomputed.non_trainable_variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(actual), keras.ops.convert_to_numpy(expected))


@pytest.mark.parametrize("mixed_policy", ["mixed_float16"], indirect=True)
def test_recompute_under_mixed_precision_matches_plain(mixed_policy):
    # the recomputation runs outside the block's autocast scope: kernels must still be cast
    plain = build_unet(2, 3, **TINY)
    recomputed = build_unet(2, 3, recompute=True, **TINY)
    copy_state(plain, recomputed)
    images = random_images((1, 16, 16, 16))  # bottleneck 4³: TF's CPU half-precision
    # Conv3D filter gradient misbehaves when the volume is smaller than the kernel
    _, plain_grads = gradients(plain, images, use_tf_function=True)
    _, recomputed_grads = gradients(recomputed, images, use_tf_function=True)
    for variable, expected, actual in zip(plain.trainable_variables, plain_grads, recomputed_grads):
        assert actual.dtype == "float32", variable.path
        scale = float(np.abs(expected).max()) + 1e-6
        np.testing.assert_allclose(actual, expected, atol=1e-2 * scale, err_msg=variable.path)


@pytest.mark.slow
def test_recompute_model_trains_with_fit():
    model = build_unet(2, 2, recompute=True, norm="batch", filters=(4, 8), strides=(1, 2))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    images = random_images((2, 8, 8, 8))
    history = model.fit(images, (images[..., 0] > 0).astype("int32"), epochs=3, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


# ------------------------------------------------------- downsampling first level


@pytest.mark.parametrize("output_upsampling", ["refine", "light", "transposed", "transposed_image"])
@pytest.mark.parametrize("patch", [(16, 16, 16), (32, 16, 48)])
def test_first_level_stride_2_gives_logits_at_input_resolution(output_upsampling, patch):
    model = build_unet(
        2, 4, filters=(4, 8, 16, 32), strides=(2, 2, 2, 1), num_res_units=1, output_upsampling=output_upsampling
    )
    half = tuple(p // 2 for p in patch)
    assert tuple(model.get_layer("encoder0").output.shape[1:4]) == (None, None, None)  # dynamic sizes
    encoder0 = keras.Model(model.input, model.get_layer("encoder0").output)
    assert tuple(encoder0(random_images((1, *patch))).shape) == (1, *half, 4), "the first level must downsample"
    logits = model(random_images((1, *patch)))
    assert tuple(logits.shape) == (1, *patch, 4) and logits.dtype == "float32"
    names = [layer.name for layer in model.layers]
    if output_upsampling == "refine":
        assert "decoder_full" in names and isinstance(model.get_layer("head"), keras.layers.Conv3D)
        full = model.get_layer("decoder_full")
        assert full.strides == 2 and full.upsample_filters == 2, "4 filters - 2 image channels"
        assert full.fuse.projection is None, "features + image = filters[0] channels: identity residual"
    elif output_upsampling == "light":
        assert "upsample_full" in names and "concat_image" in names
        assert model.get_layer("head").kernel_size == (3, 3, 3)
        assert model.get_layer("concat_image").output.shape[-1] == 4
    else:
        assert "decoder_full" not in names
        assert isinstance(model.get_layer("head"), keras.layers.Conv3DTranspose)
        assert model.get_layer("head").strides == (2, 2, 2)
        assert ("image_head" in names) == (output_upsampling == "transposed_image")


def test_transposed_image_adds_a_zero_initialised_convolution_of_the_image_to_the_transposed_logits():
    """`transposed_image` starts as `transposed` (its image kernel is zero), and its logits are the transposed
    head's plus the image correlated with the image kernel (zero 'same' padding), the latter computed here with
    scipy.ndimage.correlate per input and output channel."""
    from scipy import ndimage

    keras.utils.set_random_seed(3)
    model = build_unet(
        2, 3, filters=(4, 8, 16), strides=(2, 2, 1), num_res_units=1, output_upsampling="transposed_image"
    )
    image_head = model.get_layer("image_head")
    assert image_head.kernel.shape == (3, 3, 3, 2, 3) and not image_head.use_bias
    assert float(np.abs(keras.ops.convert_to_numpy(image_head.kernel)).max()) == 0.0
    kernel = np.random.default_rng(0).normal(size=(3, 3, 3, 2, 3)).astype(np.float32)
    image_head.kernel.assign(kernel)
    images = random_images((1, 16, 12, 8))
    transposed = keras.Model(model.input, model.get_layer("head").output)
    expected_image_term = np.stack(
        [
            sum(
                ndimage.correlate(
                    images[0, ..., c].astype(np.float64), kernel[..., c, o].astype(np.float64), mode="constant"
                )
                for c in range(2)
            )
            for o in range(3)
        ],
        axis=-1,
    )
    logits = keras.ops.convert_to_numpy(model(images))[0]
    np.testing.assert_allclose(
        logits - keras.ops.convert_to_numpy(transposed(images))[0], expected_image_term, rtol=1e-4, atol=1e-4
    )


def test_full_resolution_upsample_filters_make_image_and_features_a_block_of_filters0():
    assert full_resolution_upsample_filters(8, 2) == 6
    assert full_resolution_upsample_filters(16, 4) == 12
    assert full_resolution_upsample_filters(8, 4) == 4
    assert full_resolution_upsample_filters(8, 5) == 8, "fewer than half the features: keep filters[0]"
    model = build_unet(4, 3, filters=(8, 16), strides=(2, 1), output_upsampling="refine")
    assert model.get_layer("decoder_full").upsample_filters == 4
    assert tuple(model(random_images((1, 8, 8, 8), channels=4)).shape) == (1, 8, 8, 8, 3)


def test_first_level_stride_1_ignores_output_upsampling():
    plain = build_unet(2, 3, **TINY)
    other = build_unet(2, 3, output_upsampling="transposed", **TINY)
    assert [layer.name for layer in plain.layers] == [layer.name for layer in other.layers]
    assert "decoder_full" not in [layer.name for layer in plain.layers]
    assert plain.count_params() == other.count_params()


def test_anisotropic_first_stride_keeps_shape_and_needs_its_divisor():
    strides = ((2, 2, 1), 2, 2)
    model = build_unet(1, 3, filters=(4, 8, 16), strides=strides, num_res_units=1)
    assert check_patch_size((16, 16, 4), strides) == (8, 8, 4)
    assert tuple(model(random_images((2, 16, 16, 4), channels=1)).shape) == (2, 16, 16, 4, 3)
    with pytest.raises(ValueError, match="check_patch_size"):
        model(random_images((1, 16, 16, 6), channels=1))


@pytest.mark.parametrize("output_upsampling", ["refine", "light", "transposed", "transposed_image"])
def test_first_level_stride_2_trains_every_variable(output_upsampling):
    keras.utils.set_random_seed(0)
    model = build_unet(
        2, 2, filters=(4, 8, 16), strides=(2, 2, 1), num_res_units=1, output_upsampling=output_upsampling
    )
    images = random_images((2, 16, 16, 16))
    labels = (images[..., 0] > 0).astype("int32")  # full-resolution detail the output must recover
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(1e-2)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, [tf.reduce_sum(tf.abs(g)) for g in grads]

    first, grad_norms = train_step()
    assert all(float(n) > 0 for n in grad_norms), "every variable gets a gradient"
    losses = [float(first)] + [float(train_step()[0]) for _ in range(9)]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("output_upsampling", ["refine", "light", "transposed", "transposed_image"])
def test_first_level_stride_2_save_load_and_config_round_trip(tmp_path, output_upsampling):
    config = UNetConfig(
        2, 3, filters=(4, 8, 16), strides=(2, 2, 1), num_res_units=1, output_upsampling=output_upsampling
    )
    assert UNetConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["output_upsampling"] == output_upsampling
    assert not config.full_resolution_first_level and UNetConfig(2, 3, **TINY).full_resolution_first_level
    model = config.build()
    path = tmp_path / "strided.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    images = random_images((1, 16, 8, 24))
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(images)), keras.ops.convert_to_numpy(restored(images))
    )
    with pytest.raises(ValueError, match="output_upsampling must be one of"):
        UNetConfig(2, 3, filters=(4, 8), strides=(2, 2), output_upsampling="nearest")


# ----------------------------------------------------------------------- deep supervision


@pytest.mark.parametrize(
    "filters, strides, levels, sizes",
    [
        # the first layer downsamples: heads on decoder0 and decoder1
        ((4, 8, 16), (2, 2, 1), [0, 1], [(16, 16, 8), (8, 8, 4), (4, 4, 2)]),
        # full resolution: decoder0 is at the output's resolution, so decoder1 and decoder2 (z not pooled at level 2)
        ((4, 8, 16, 32), (1, 2, (2, 2, 1), 2), [1, 2], [(16, 16, 8), (8, 8, 4), (4, 4, 4)]),
    ],
)
def test_deep_supervision_heads_sit_on_the_decoder_levels_below_the_output(filters, strides, levels, sizes):
    """build_for_training with deep_supervision=2: the training model returns [logits, head, head] at the decoder
    levels coarser than the output, finest first (anisotropic strides included); the inference model shares its
    layers and returns the same logits, and its weights are the training model's minus the heads'."""
    config = UNetConfig(2, 3, filters=filters, strides=strides, num_res_units=1, deep_supervision=2)
    assert [level for level, _ in config.deep_supervision_levels] == levels
    model, training_model = config.build_for_training()
    images = random_images((1, 16, 16, 8))
    outputs = training_model(images, training=False)
    assert [tuple(o.shape[1:4]) for o in outputs] == sizes and all(o.shape[-1] == 3 for o in outputs)
    assert all(o.dtype == "float32" for o in outputs)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(images, training=False)), keras.ops.convert_to_numpy(outputs[0])
    )
    head_weights = {id(w) for level in levels for w in training_model.get_layer(f"deep_supervision{level}").weights}
    assert {id(w) for w in model.weights} == {id(w) for w in training_model.weights} - head_weights
    plain, same = UNetConfig(2, 3, filters=filters, strides=strides).build_for_training()
    assert plain is same
    with pytest.raises(ValueError, match=r"deep_supervision must be between 0 and 2 .* got 3"):
        UNetConfig(2, 3, filters=filters, strides=strides, deep_supervision=3)


# ------------------------------------------------------------------- initialisation


def _conv_kernels(model):
    """(name, kernel) of every Conv3D / Conv3DTranspose in `model`, nested blocks included."""
    return [
        (layer.name, keras.ops.convert_to_numpy(layer.kernel))
        for layer in model._flatten_layers()
        if isinstance(layer, (keras.layers.Conv3D, keras.layers.Conv3DTranspose))
    ]


def _torch_fan_in(kernel: np.ndarray) -> int:
    """PyTorch's fan-in of the same weight: (out, in, k, k, k) for a convolution, (in, out, k, k, k) for a
    transposed one: size(1) times the receptive field. Keras stores both as (k, k, k, a, b), with `a` what torch
    has at size(1)."""
    return int(np.prod(kernel.shape[:3])) * kernel.shape[3]


@pytest.mark.parametrize("output_upsampling", ["refine", "light", "transposed"])
def test_pytorch_kernel_initializer_draws_every_convolution_from_torchs_kaiming_uniform_bound(output_upsampling):
    """`kernel_initializer: pytorch` = torch.nn.init.kaiming_uniform_(w, a=sqrt(5)), PyTorch's Conv default:
    bound = gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a^2)), written out here from torch's formula; every
    kernel (blocks, residual projections, transposed convolutions, heads) lies within it and has the uniform's
    standard deviation bound / sqrt(3). The default stays He-normal (std sqrt(2 / fan_in))."""
    config = UNetConfig(
        2,
        4,
        filters=(8, 16, 32, 64),
        strides=(2, 2, 2, 1),
        num_res_units=1,
        output_upsampling=output_upsampling,
        deep_supervision=2,
        kernel_initializer="pytorch",
    )
    _, training_model = config.build_for_training()
    kernels = _conv_kernels(training_model)
    assert any(name.startswith("deep_supervision") for name, _ in kernels) and any(n == "head" for n, _ in kernels)
    for name, kernel in kernels:
        bound = np.sqrt(2.0 / (1.0 + 5.0)) * np.sqrt(3.0 / _torch_fan_in(kernel))
        assert np.abs(kernel).max() <= bound * (1 + 1e-6), name
        if kernel.size >= 2000:  # enough draws for the standard deviation to be within 10 %
            assert abs(kernel.std() / (bound / np.sqrt(3.0)) - 1.0) < 0.1, name
    default = UNetConfig(
        2, 4, filters=(8, 16, 32, 64), strides=(2, 2, 2, 1), num_res_units=1, output_upsampling=output_upsampling
    ).build()
    for name, kernel in _conv_kernels(default):
        if kernel.size >= 2000 and name != "head":
            # He-normal is truncated at 2 sd, which leaves 88 % of the variance
            assert abs(kernel.std() / np.sqrt(0.88 * 2.0 / _torch_fan_in(kernel)) - 1.0) < 0.1, name


def test_kernel_initializer_is_a_validated_config_key_that_survives_save_and_load(tmp_path):
    config = UNetConfig.from_dict(
        {"in_channels": 2, "num_classes": 3, "filters": [8, 16], "strides": [2, 1], "kernel_initializer": "pytorch"}
    )
    assert UNetConfig.from_dict(config.to_dict()).kernel_initializer == "pytorch"
    with pytest.raises(ValueError, match="kernel_initializer must be one of"):
        UNetConfig(1, 2, kernel_initializer="xavier")
    model = config.build()
    path = tmp_path / "unet.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.get_layer("encoder0").kernel_initializer == "pytorch"
    images = random_images((1, 8, 8, 8))
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(images)), keras.ops.convert_to_numpy(restored(images))
    )
