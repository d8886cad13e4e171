"""U-shaped S2FL through the real services, with every device-side privacy defence (the split floor
included) and local-DP label counts, and both servers recording what they receive (``--record-received``): no label reaches the
Main Server, and what it received is what the defences say it should be."""
from __future__ import annotations

import torch

from benchmarks.privacy_records import read_records
from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config
from shared.models import build_model
from shared.recording import BANNER
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

NOISE = 0.5
FLOOR = 2


def test_u_shaped_run_sends_no_label_to_the_main_server(tmp_path):
    config = small_config(rounds=2, **{
        "split.u_shaped": True, "split_privacy.label_counts": "local_dp", "split_privacy.label_counts_epsilon": 1.0,
        "split_privacy.defences": ["floor", "nopeek", "noise", "label_noise"],
        "split_privacy.defence_params": {"floor": {"split": FLOOR}, "noise": {"scale": NOISE}, "nopeek": {"weight": 0.2},
                                         "label_noise": {"epsilon": 3.0}},
        "deadlines.patience": None})
    records = tmp_path / "records"
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, warm=shared_starter(),
                 server_args=["--record-received", str(records), "--record-steps", "2"]) as testbed:
        status = testbed.follow(timeout=240.0)
    assert status["state"] == "finished"
    metrics = read_metrics(run_dir)
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    head = len(build_model("cnn").blocks) - 1
    # The devices' cuts all lie before their head (block 3): the cnn's cut 3 is not a candidate;
    # and none is shallower than the floor, though the warm-up puts every device at cut 1 first.
    assert all(FLOOR <= k < head for m in metrics for k in m["split_points"].values())
    summary = status["summary"]
    assert summary["final_accuracy"] > summary["initial_accuracy"]
    # The head was trained on the devices and aggregated from their uploads: it moved.
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model("cnn", 10, (1, 28, 28), seed=config.seed).state_dict()
    assert not torch.equal(state["blocks.head.weight"], initial["blocks.head.weight"])
    for log in ("main_server", "fed_server"):
        assert BANNER in (run_dir / "logs" / f"{log}.log").read_text()

    # What the Main Server received, file by file: activations and gradients, never a label.
    main_files = sorted(p.name for p in (records / "main_server").rglob("*") if p.is_file())
    assert not [name for name in main_files if "label" in name and not name.endswith("-join.json")]
    assert any(name.endswith("-fx.npy") for name in main_files)
    model = build_model("cnn", 10, (1, 28, 28), seed=config.seed)
    rounds = read_records(records, config, model)
    assert [r.round_index for r in rounds] == [1, 2]
    steps = [s for r in rounds for s in r.steps]
    assert len(steps) == 2 * config.data.num_devices * 2   # rounds x devices x --record-steps
    for step in steps:
        assert step.labels is None
        assert step.gradient is not None and step.gradient.shape == (len(step.y), 512)
        assert step.fx.shape[0] == len(step.y)

    # Label counts: sent with local-DP noise, not as they are.
    for r in rounds:
        assert set(r.joins) == set(r.true_counts)
        assert any(r.joins[d] != r.true_counts[d] for d in r.joins)

    # Activation noise: a device's first step of a round starts from the round's global model, so
    # the clean activations are known; what arrived is them plus noise of NOISE x their RMS.
    ratios = []
    for r in rounds:
        assert r.global_state is not None
        model.load_state_dict(r.global_state)
        for step in (s for s in r.steps if s.step == 0):
            with torch.no_grad():
                clean = model.portion(0, step.split_point)(step.x)
            rms = clean.flatten(1).pow(2).mean(dim=1).sqrt()
            noise = (step.fx - clean).flatten(1).pow(2).mean(dim=1).sqrt()
            ratios.append(float((noise / rms).median()))
    assert ratios and all(abs(ratio - NOISE) < 0.1 for ratio in ratios), ratios
