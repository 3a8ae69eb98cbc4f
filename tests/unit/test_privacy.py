"""Client-level DP: the accountant (the analytic Gaussian mechanism, composed as Gaussian DP) and the noise the
FedAvg server adds to a round's sum."""

from __future__ import annotations

import math

import pytest
import torch

from cleave.errors import ConfigError
from cleave.methods import fedavg, privacy


def test_the_accountant_is_the_analytic_gaussian_mechanism():
    eps = privacy.epsilon(1.0, 1, 1e-5)
    # at that epsilon, delta is the analytic Gaussian mechanism's (Balle and Wang 2018) for sigma = 1
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    assert phi(-eps + 0.5) - math.exp(eps) * phi(-eps - 0.5) == pytest.approx(1e-5, rel=1e-6)
    # and below the classical bound's epsilon for that sigma (sqrt(2 ln(1.25/delta)) / sigma)
    assert eps < math.sqrt(2 * math.log(1.25 / 1e-5))
    # T rounds of noise z are one mechanism of noise z / sqrt(T); more noise, less epsilon; more rounds, more
    assert privacy.epsilon(2.0, 4, 1e-5) == pytest.approx(privacy.epsilon(1.0, 1, 1e-5), rel=1e-9)
    assert privacy.epsilon(1.0, 10, 1e-5) > privacy.epsilon(1.0, 9, 1e-5) > privacy.epsilon(2.0, 9, 1e-5)
    assert privacy.epsilon(1.0, 0, 1e-5) == 0.0 and privacy.epsilon(0.0, 3, 1e-5) == math.inf


def test_the_server_adds_noise_of_z_times_clip_to_the_sum():
    n, z, clip = 4, 0.5, 2.0
    params = {"w": torch.nn.Parameter(torch.zeros(200_000))}
    server = fedavg.FedAvgServer(params, fedavg.FedAvgConfig(dp_noise=z, clip=clip))
    for i in range(n):
        server.submit(f"c{i}", 0, {"w": torch.full((200_000,), 1.0)}, 1.0)
    assert server.close_round().applied
    got = params["w"].detach()
    assert got.mean().item() == pytest.approx(1.0, abs=0.01)
    assert got.std().item() == pytest.approx(z * clip / n, rel=0.01)  # on the mean: std z*C/n
    with pytest.raises(ConfigError, match="dp_noise needs clip"):
        fedavg.FedAvgConfig(dp_noise=1.0)


def test_a_dp_job_commits_every_round_before_its_weights_go_out():
    """With persist_every 3, a PS killed after round 4 ran rounds 3 and 4 again with fresh noise after their noised
    weights had gone out: 10 releases, epsilon reported for 8. With checkpoint staging the next round was dealt
    while its commit streamed. A DP job takes neither."""
    from cleave.runtime.faults import Faults
    from cleave.train.job import JobConfig
    from cleave_ps.settings import PsSettings
    from cleave_ps.state.persist import Progress

    dp = JobConfig(job_id="dp", method="fedavg", preset="tiny", update_clip=1.0, dp_noise=1.0)
    for settings, said in (({"persist_every": 3}, "not 3 and 'off'"), ({"checkpoint_staging": "auto"}, "not 0 and 'auto'")):
        with pytest.raises(ConfigError, match=f"needs persist_every 1 and checkpoint_staging off, {said}"):
            Progress(None, dp, PsSettings(**settings), Faults(""))
    assert Progress(None, dp, PsSettings(persist_every=1), Faults("")).every == 1
    assert Progress(None, dp.model_copy(update={"dp_noise": 0.0}), PsSettings(persist_every=3), Faults("")).every == 3
