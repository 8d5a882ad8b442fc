import contextlib
import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from vip_hub.cli.main import main
from vip_hub.privacy.accounting import (
    Accountant,
    AccountingError,
    calibrate,
    composed_epsilon,
    default_delta,
    epsilon,
    epsilons,
    max_steps_within,
    remaining_epsilon,
    resolve_delta,
)

# The reference's PRETRAIN.md configuration (notes/dp-training.md): RDP 7.00, PRV 5.98.
N = 233_000_000
Q, SIGMA, STEPS, DELTA = 81920 / N, 0.5, 10_000, 1 / (2 * N)


def test_reference_config_values():
    assert epsilon(SIGMA, Q, STEPS, DELTA) == pytest.approx(7.00, abs=0.01)
    assert epsilon(SIGMA, Q, STEPS, DELTA, "prv") == pytest.approx(5.98, abs=0.02)
    assert epsilon(SIGMA, Q, STEPS, DELTA, "pld") == pytest.approx(5.98, abs=0.02)


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [
        (5.6, 262144 / 1281167, 1500, 8e-7),  # ViP paper App. A.5, ImageNet fine-tuning
        (SIGMA, Q, STEPS, DELTA),  # PRETRAIN.md: B 81920, n 233M, delta 1/2n
    ],
)
def test_pld_agrees_with_prv_and_rdp_is_the_largest(sigma, q, steps, delta):
    eps = epsilons(sigma, q, steps, delta)
    assert eps["pld"] == pytest.approx(eps["prv"], rel=0.01)
    assert eps["rdp"] > max(eps["prv"], eps["pld"])


def test_max_steps_within_is_the_last_step_inside_the_budget():
    for accountant in ("rdp", "pld"):
        t = max_steps_within(3.0, 1.0, 0.05, 1e-5, 10_000, accountant)
        assert (
            epsilon(1.0, 0.05, t, 1e-5, accountant)
            <= 3.0
            < epsilon(1.0, 0.05, t + 1, 1e-5, accountant)
        )
    assert max_steps_within(3.0, 1.0, 0.05, 1e-5, 10, "rdp") == 10


def test_epsilon_grows_with_steps_and_falls_with_sigma():
    assert epsilon(1.0, 0.01, 200, 1e-5) < epsilon(1.0, 0.01, 400, 1e-5)
    assert epsilon(2.0, 0.01, 200, 1e-5) < epsilon(1.0, 0.01, 200, 1e-5)


def test_composition_of_equal_runs_equals_one_longer_run():
    a = composed_epsilon([(1.0, 0.02, 100), (1.0, 0.02, 150)], 1e-5)
    assert a == pytest.approx(epsilon(1.0, 0.02, 250, 1e-5), rel=1e-9)
    assert composed_epsilon([], 1e-5) == 0.0


def test_rdp_is_exactly_what_opacus_rdp_accountant_reports() -> None:
    """The claim's RDP figure (one step's RDP per (sigma, q, order) computed once, times the
    steps, summed over the runs; an order skipped where a bound shows it cannot give the least)
    is opacus' RDPAccountant's at every order, to the last bit: on histories whose least order is
    whole, fractional, the smallest or the largest, at sampling rates up to 1."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from vip_hub.privacy.accounting import rdp_alphas

    histories = [
        [(SIGMA, Q, STEPS)],
        [(7.69, 0.125, 800), (1.34, 0.125, 10)],
        [(1.1, 0.01, 300), (2.5, 1 / 3, 7), (1.1, 0.01, 41)],
        [(0.5, 1.0, 1)],
        [(20.0, 1.0, 1)],
        [(0.3, 0.5, 50)],
        [(200.0, 0.001, 10)],
    ]
    histories += [
        [(sigma, q, steps)]
        for sigma in (0.6, 1.2, 5.0)
        for q in (0.0032, 0.125, 0.5)
        for steps in (1, 400)
    ]
    optima = set()
    with warnings.catch_warnings():  # opacus warns where the least order ends the range
        warnings.simplefilter("ignore")
        for i, history in enumerate(histories):
            # what RDPAccountant.get_epsilon computes: its curve, get_privacy_spent at each delta
            curve = sum(
                compute_rdp(q=q, noise_multiplier=s, steps=t, orders=rdp_alphas())
                for s, q, t in history
            )
            for delta in (1e-5, DELTA, 0.3):
                expected, order = get_privacy_spent(orders=rdp_alphas(), rdp=curve, delta=delta)
                if i < 3:  # the accountant itself agrees
                    acc = RDPAccountant()
                    acc.history = list(history)
                    assert acc.get_epsilon(delta=delta, alphas=rdp_alphas()) == expected
                assert composed_epsilon(history, delta) == max(expected, 0.0), (history, delta)
                optima.add(order)
    assert {a for a in optima if not float(a).is_integer()}  # the skipping was put to the test
    assert min(rdp_alphas()) in optima or max(rdp_alphas()) in optima


@pytest.mark.parametrize("accountant", ["rdp", "prv", "pld"])
def test_calibrate_inverts_epsilon(accountant):
    n = 1797
    q, steps, delta = 64 / n, 150, default_delta(n)
    sigma = calibrate(8.0, delta, q, steps, accountant)
    eps = epsilon(sigma, q, steps, delta, accountant)
    assert eps <= 8.0 and eps > 8.0 - 0.02
    assert epsilon(sigma * 0.98, q, steps, delta, accountant) > 8.0 - 0.01


def test_remaining_epsilon_calibrates_a_run_so_the_composition_is_the_total():
    """An encoder at epsilon 2, then a head calibrated to what remains: the two compose to the
    total (within the calibration's tolerance), more than the 1 left by adding epsilons, and
    calibrating the head to any more would pass the total."""
    n, delta = 20_000, 1e-5
    encoder = (calibrate(2.0, delta, 256 / n, 70), 256 / n, 70)
    q, steps = 1 / 40, 3600
    own = remaining_epsilon(3.0, delta, [encoder], q, steps)
    assert 1.0 < own < 3.0
    composed = composed_epsilon([encoder, (calibrate(own, delta, q, steps), q, steps)], delta)
    assert 3.0 - 0.02 < composed <= 3.0
    greedy = calibrate(own * 1.02, delta, q, steps)
    assert composed_epsilon([encoder, (greedy, q, steps)], delta) > 3.0
    assert remaining_epsilon(3.0, delta, [], q, steps) == 3.0  # nothing spent before
    with pytest.raises(AccountingError, match="already spend epsilon"):
        remaining_epsilon(1.5, delta, [encoder], q, steps)


@pytest.mark.parametrize("spent", [0, 1], ids=["no-prior", "an-encoder"])
def test_remaining_epsilon_shares_the_rest_among_several_runs(spent: int):
    """Three draws of a head after an encoder (or none): each calibrated to the epsilon
    returned, the encoder and all three compose to the total, each draw is noisier than one
    draw alone would be, and each calibrated to any more would pass the total."""
    n, delta = 10_000, 1e-5
    encoder = [(calibrate(0.5, delta, 256 / n, 70), 256 / n, 70)][:spent]
    q, steps, runs = 1 / 2, 96, 3
    each = remaining_epsilon(3.0, delta, encoder, q, steps, runs=runs)
    alone = remaining_epsilon(3.0, delta, encoder, q, steps)
    assert each < alone
    sigma = calibrate(each, delta, q, steps)
    assert sigma > calibrate(alone, delta, q, steps)
    composed = composed_epsilon([*encoder, *[(sigma, q, steps)] * runs], delta)
    assert 3.0 - 0.02 < composed <= 3.0
    greedy = calibrate(each * 1.02, delta, q, steps)
    assert composed_epsilon([*encoder, *[(greedy, q, steps)] * runs], delta) > 3.0
    with pytest.raises(AccountingError, match="runs must be at least 1"):
        remaining_epsilon(3.0, delta, encoder, q, steps, runs=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(sigma=1.0, sample_rate=0.0, steps=10, delta=1e-5),
            r"sample rate q must be in \(0, 1\]",
        ),
        (
            dict(sigma=1.0, sample_rate=1.5, steps=10, delta=1e-5),
            r"sample rate q must be in \(0, 1\]",
        ),
        (dict(sigma=1.0, sample_rate=0.1, steps=10, delta=0.0), r"delta must be in \(0, 1\)"),
        (dict(sigma=1.0, sample_rate=0.1, steps=10, delta=1.0), r"delta must be in \(0, 1\)"),
        (dict(sigma=0.0, sample_rate=0.1, steps=10, delta=1e-5), "sigma must be positive"),
        (dict(sigma=-1.0, sample_rate=0.1, steps=10, delta=1e-5), "sigma must be positive"),
        (dict(sigma=1.0, sample_rate=0.1, steps=0, delta=1e-5), "steps must be a positive integer"),
    ],
)
def test_impossible_inputs(kwargs, match):
    with pytest.raises(AccountingError, match=match):
        epsilon(**kwargs)


def test_unreachable_and_unknown():
    with pytest.raises(AccountingError, match="no noise multiplier reaches epsilon"):
        calibrate(1e-4, 1e-5, 1.0, 100_000)
    with pytest.raises(AccountingError, match="unknown accountant 'gdp'"):
        epsilon(1.0, 0.1, 10, 1e-5, "gdp")
    with pytest.raises(AccountingError, match="target epsilon must be a positive"):
        calibrate(0, 1e-5, 0.1, 10)
    with pytest.raises(AccountingError, match="dataset size must be positive"):
        default_delta(0)


def test_a_stage_states_the_delta_given_else_the_default_for_its_n():
    assert resolve_delta(None, 1_000) == default_delta(1_000) == 1e-5  # capped at 1e-5
    assert resolve_delta(None, 10**6) == default_delta(10**6) == pytest.approx(1e-7)  # 1/(10n)
    assert resolve_delta(3e-7, 1_000) == 3e-7  # an explicit delta, never replaced


def test_prv_refuses_by_name_an_epsilon_its_grid_cannot_hold():
    """At sigma 1e-4 the PRV grid would need terabytes; a clear error comes first."""
    with pytest.raises(AccountingError, match="beyond what the PRV accountant can compute"):
        epsilon(1e-4, 1 / 8, 48, 1e-5, "prv")
    assert epsilon(0.2, 1 / 8, 48, 1e-5, "prv") < epsilon(0.2, 1 / 8, 48, 1e-5, "rdp")


@pytest.mark.parametrize("sigma,size", [(1e-300, "small"), (1e300, "large")])
def test_sigma_past_the_arithmetic_is_named_by_its_side(sigma, size):
    """A sigma whose square under- or overflows is refused by name, saying which way it is off."""
    with pytest.raises(AccountingError, match=f"far too {size}"):
        epsilon(sigma, 0.01, 10, 1e-5)


def _cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_console_script():
    script = Path(sys.executable).with_name("vip-hub")
    r = subprocess.run(
        [
            str(script),
            "epsilon",
            "--sigma",
            "1",
            "--sample-rate",
            "0.01",
            "--steps",
            "100",
            "--delta",
            "1e-5",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["epsilon"] == pytest.approx(epsilon(1, 0.01, 100, 1e-5))


def test_cli_prints_delta_exactly(capsys):
    """A delta just below 1 is printed as given, not rounded to 1 (which no guarantee may reach)."""
    args = ("--sample-rate", "0.01", "--steps", "100", "--delta", "0.9999999")
    r = _cli(capsys, "calibrate", "--epsilon", "3", *args)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("delta=0.9999999"), r.stdout


def test_cli_epsilon_and_calibrate(capsys):
    r = _cli(
        capsys,
        "epsilon",
        "--sigma",
        "0.5",
        "--sample-rate",
        str(Q),
        "--steps",
        "10000",
        "--delta",
        str(DELTA),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["epsilon"] == pytest.approx(7.00, abs=0.01) and out["accountant"] == "rdp"
    r = _cli(
        capsys,
        "epsilon",
        "--sigma",
        "0.5",
        "--sample-rate",
        str(Q),
        "--steps",
        "10000",
        "--delta",
        str(DELTA),
        "--accountant",
        "prv",
    )
    assert r.returncode == 0 and "epsilon = 5.9" in r.stdout and "(prv)" in r.stdout
    r = _cli(
        capsys,
        "calibrate",
        "--epsilon",
        "8",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.01",
        "--steps",
        "1000",
        "--json",
    )
    out = json.loads(r.stdout)
    assert 0.5 < out["sigma"] < 0.7 and out["epsilon"] <= 8


def test_cli_errors_are_one_line(capsys):
    r = _cli(
        capsys, "epsilon", "--sigma", "1", "--sample-rate", "2", "--steps", "10", "--delta", "1e-5"
    )
    assert r.returncode == 1
    assert r.stderr.strip() == "vip-hub epsilon: error: sample rate q must be in (0, 1], got 2.0"
    r = _cli(
        capsys,
        "calibrate",
        "--epsilon",
        "0.0001",
        "--delta",
        "1e-5",
        "--sample-rate",
        "1",
        "--steps",
        "100000",
    )
    assert r.returncode == 1 and "no noise multiplier reaches epsilon" in r.stderr


def test_a_delta_below_what_the_prv_grid_resolves_is_an_accounting_error():
    """``--delta 1e-30`` (or ``--audit-delta``) was opacus' ``ValueError`` traceback from the PRV
    accountant, which every run and the audit compute: an AccountingError naming the delta."""
    with pytest.raises(AccountingError, match="delta 1e-30 is too small for the PRV"):
        epsilon(1.0, 0.01, 100, 1e-30, "prv")
    assert (
        main(
            [
                "epsilon",
                "--sigma=1",
                "--sample-rate=0.01",
                "--steps=100",
                "--delta=1e-30",
                "--accountant=prv",
            ]
        )
        == 1
    )


@pytest.mark.parametrize("delta", [0.1, 0.3, 0.5, 0.9])
def test_no_accountant_states_a_negative_epsilon_at_a_large_delta(delta):
    """RDP's and PRV's conversions printed epsilon -0.02 at delta 0.1 and -0.68 at 0.5 (sigma 1,
    q 0.01, 100 steps), where dp_accounting's PLD states 0: a mechanism (eps, delta)-DP for an
    eps < 0 is (0, delta)-DP, and a ledger states 0."""
    for accountant in ("rdp", "prv", "pld"):
        try:
            eps = epsilon(1.0, 0.01, 100, delta, accountant)
        except AccountingError as e:  # PRV's grid, at a delta above each of its deltas
            assert accountant == "prv" and "too large for the PRV accountant" in str(e)
            continue
        assert eps == 0.0, accountant


def test_a_delta_above_what_the_prv_grid_resolves_is_an_accounting_error():
    """At delta 0.99 opacus' PRV accountant raised a bare ``RuntimeError: Cannot compute
    epsilon``: an AccountingError naming the delta."""
    with pytest.raises(AccountingError, match="delta 0.99 is too large for the PRV accountant"):
        epsilon(1.0, 0.01, 100, 0.99, "prv")


def test_a_delta_below_what_the_pld_grid_resolves_is_no_guarantee_verify_takes():
    """PLD's epsilon at a delta below its grid's resolution is inf, which ``epsilon`` handed
    back (``vip-hub epsilon`` printed ``epsilon = inf`` and exited 0) and verify compared as
    ``inf - 1e-9 inf``, NaN: a guarantee forged to (0.5, 1e-16) under PLD verified, where RDP at
    that delta gives 5.6. An AccountingError naming the delta, and a problem in verify."""
    from vip_hub.privacy.ledger import Dataset, DPStage, PrivacyLedger, truncated
    from vip_hub.repo.verify import VerificationReport, _check_accounting

    with pytest.raises(AccountingError, match="no finite epsilon at delta 1e-16"):
        epsilon(1.0, 0.01, 1000, 1e-16, "pld")
    args = ["--sigma=1", "--sample-rate=0.01", "--steps=1000", "--delta=1e-16", "--accountant=pld"]
    assert main(["epsilon", *args]) == 1
    stage = DPStage.from_parameters(
        name="ft",
        dataset=Dataset(name="org/data", size=10**6),
        sample_rate=0.01,
        noise_multiplier=1.0,
        steps=1000,
        clipping_norm=1.0,
        noised_tensors={"unreleased:w": 1000},
        delta=1e-7,
    )
    ledger = PrivacyLedger.build([stage]).to_dict()
    ledger["guarantees"][0].update(accountant="pld", delta=1e-16 + truncated([stage]), epsilon=0.5)
    report = VerificationReport(ledger=PrivacyLedger.parse(ledger))
    _check_accounting(report.ledger, report)
    assert any("no finite epsilon" in str(p) for p in report.problems), report.problems


def test_pld_calibration_where_its_grid_lies_above_rdp():
    """PLD on its 1e-3 grid gives more than RDP at RDP's sigma here (0.224 against 0.201), so
    the search's bracket, which took RDP's sigma for its upper end, did not hold a root: brentq's
    ValueError. The sigma returned reaches the target under PLD."""
    sigma = calibrate(0.2, 1e-5, 0.001, 10_000, "pld")
    assert epsilon(sigma, 0.001, 10_000, 1e-5, "pld") <= 0.2
    assert sigma > calibrate(0.2, 1e-5, 0.001, 10_000, "rdp")


def test_accountants_in_threads_leave_the_warning_filters_as_they_found_them(monkeypatch) -> None:
    """The accountants silence their numerical warnings with ``warnings.catch_warnings``, which
    saves and restores the process's filters: two threads inside it at once, the first leaving
    first, left ``ignore`` in force for the whole process (the service computes epsilons in
    worker threads). Here the two meet inside it when they can, then leave in that order."""
    from opacus.accountants.analysis import rdp

    met, first_left, real = threading.Barrier(2), threading.Event(), rdp.get_privacy_spent

    def meeting(*args, **kwargs):
        with contextlib.suppress(threading.BrokenBarrierError):  # one at a time: no meeting
            met.wait(timeout=1)
        if threading.current_thread().name == "second":
            first_left.wait(timeout=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rdp, "get_privacy_spent", meeting)
    before, computed = list(warnings.filters), []

    def work(sigma: float) -> None:
        computed.append(epsilon(sigma, 0.01, 100, 1e-5, Accountant.RDP))  # no other test's sigma
        if threading.current_thread().name == "first":
            first_left.set()

    threads = [
        threading.Thread(target=work, args=(sigma,), name=name)
        for sigma, name in ((0.8123457, "first"), (0.8123459, "second"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 2  # both ran to their end
    assert warnings.filters == before
