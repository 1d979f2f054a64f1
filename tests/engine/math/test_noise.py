import pytest
import torch

from gali_cli.engine.math.noise import Noise, mix32, standard_normal, stream_key


def test_mix32_is_a_bijection_on_a_sample():
    values = torch.arange(1 << 16) * 65521
    mixed = mix32(values)
    assert mixed.unique().numel() == values.numel()
    assert int(mixed.max()) < 1 << 32 and int(mixed.min()) >= 0
    assert [mix32(int(v)) for v in values[:50]] == mixed[:50].tolist()  # ints and tensors agree


def test_standard_normal_moments_and_shape():
    z = standard_normal(Noise(seed=0, layer=3, scale=1.0), 2, 4, torch.arange(500, 564), 2048)
    assert z.shape == (2, 4, 64, 2048) and z.dtype == torch.float32
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1) < 0.01
    assert abs((z.pow(4).mean() / z.pow(2).mean().pow(2)).item() - 3) < 0.05  # Gaussian kurtosis
    assert torch.isfinite(z).all()


def test_noise_is_a_function_of_its_counters():
    noise = Noise(seed=7, layer=1, scale=1.0)
    whole = standard_normal(noise, 3, 2, torch.arange(10, 30), 100)
    # Any sub-block computed alone is the same block: independent of tiling, batch size or key count.
    part = standard_normal(noise, 2, 2, torch.arange(15, 20), 40)
    assert torch.equal(part, whole[:2, :, 5:10, :40])


@pytest.mark.parametrize("other", [Noise(seed=8, layer=1, scale=1.0), Noise(seed=7, layer=2, scale=1.0)])
def test_noise_differs_across_seeds_and_layers(other):
    base = standard_normal(Noise(seed=7, layer=1, scale=1.0), 1, 2, torch.arange(64), 256)
    changed = standard_normal(other, 1, 2, torch.arange(64), 256)
    assert torch.corrcoef(torch.stack([base.flatten(), changed.flatten()]))[0, 1].abs() < 0.03


def test_noise_is_uncorrelated_across_heads_rows_and_columns():
    z = standard_normal(Noise(seed=0, layer=0, scale=1.0), 1, 2, torch.arange(256), 512)[0]
    pairs = [(z[0], z[1]), (z[0, :-1], z[0, 1:]), (z[0, :, :-1], z[0, :, 1:])]
    for a, b in pairs:
        assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs() < 0.02


def test_stream_key_uses_all_of_a_64_bit_seed():
    keys = {stream_key(seed, 0) for seed in [0, 1, 1 << 32, (1 << 32) + 1, (1 << 63) - 1]}
    assert len(keys) == 5
