"""tests/traffic.greedy_mismatch: identical ids pass at once; a difference passes only where the
oracle's top two were a near-tie that we broke the other way, every earlier token equal."""

from __future__ import annotations

import pytest

from tests import traffic

BODY = {"model": "m", "prompt": "p", "max_tokens": 4, "temperature": 0}
ORACLE = [5, 6, 7, 8]
TOPS = [{5: -0.1, 9: -3.0}, {6: -1.20, 3: -1.23, 4: -2.0}, {7: -0.5, 1: -2.0}, {8: -0.2}]


@pytest.fixture
def oracle(monkeypatch):
    asked = []

    def choices(url, body, top=5):
        asked.append(body)
        return list(ORACLE), TOPS

    monkeypatch.setattr(traffic, "oracle_choices", choices)
    return asked


def test_identical_ids_need_no_second_request(oracle):
    assert traffic.greedy_mismatch(list(ORACLE), ORACLE, "http://oracle", BODY) is None
    assert oracle == []


def test_a_near_tie_broken_the_other_way_passes(oracle):
    # token 1: the oracle's 6 (-1.20) against our 3 (-1.23): 0.03 nats apart; what follows may differ
    assert traffic.greedy_mismatch([5, 3, 0, 0], ORACLE, "http://oracle", BODY) is None
    assert oracle == [BODY]


def test_a_difference_that_is_no_tie_fails(oracle):
    why = traffic.greedy_mismatch([5, 4, 7, 8], ORACLE, "http://oracle", BODY)  # 4 is 0.8 nats behind
    assert why and "first difference at token 1" in why and "not a near-tie" in why
    why = traffic.greedy_mismatch([5, 2, 7, 8], ORACLE, "http://oracle", BODY)  # not among the oracle's top
    assert why and "logprob None" in why
    why = traffic.greedy_mismatch([9, 6, 7, 8], ORACLE, "http://oracle", BODY)  # first token, 2.9 nats behind
    assert why and "token 0" in why


def test_lengths_and_an_unsteady_oracle_fail(oracle, monkeypatch):
    assert "3 tokens against the oracle's 4" in traffic.greedy_mismatch([5, 6, 7], ORACLE, "http://oracle", BODY)
    monkeypatch.setattr(traffic, "oracle_choices", lambda url, body, top=5: ([5, 6, 7, 9], TOPS))
    assert "the oracle answered" in traffic.greedy_mismatch([5, 3, 7, 8], ORACLE, "http://oracle", BODY)


def test_assert_greedy_names_what_differs(oracle):
    with pytest.raises(AssertionError, match="shared prefix: first difference at token 2"):
        traffic.assert_greedy([5, 6, 1, 8], ORACLE, "http://oracle", BODY, "shared prefix")


def test_the_bf16_allowance_is_wider_and_still_bounded(oracle):
    ours = [5, 6, 1, 8]  # token 2: 1 is 1.5 nats behind the oracle's 7
    assert traffic.greedy_mismatch([5, 6, 7, 8], ORACLE, "http://oracle", BODY, traffic.BF16_TIE_NATS) is None
    assert traffic.greedy_mismatch(ours, ORACLE, "http://oracle", BODY, traffic.BF16_TIE_NATS)
    # 0.8 nats: past both allowances; 0.03: within both
    assert traffic.greedy_mismatch([5, 4, 7, 8], ORACLE, "http://oracle", BODY, traffic.BF16_TIE_NATS)
    assert traffic.greedy_mismatch([5, 3, 7, 8], ORACLE, "http://oracle", BODY, traffic.BF16_TIE_NATS) is None
    tops = [{5: -2.38, 110: -2.79}, *TOPS[1:]]  # the MoE case measured here: 0.41 nat, first token
    traffic.oracle_choices = lambda url, body, top=5: (list(ORACLE), tops)
    assert traffic.greedy_mismatch([110, 0, 0, 0], ORACLE, "http://oracle", BODY, traffic.BF16_TIE_NATS) is None
    assert traffic.greedy_mismatch([110, 0, 0, 0], ORACLE, "http://oracle", BODY)  # not in float32


def test_a_slow_repeat_is_timed_again_and_fails_only_when_slow_every_time():
    again = iter([9.0, 0.3])
    assert traffic.check_repeat_times([0.2, 0.25, 4.0], lambda: next(again), "noise") == 2  # slow once, then fast
    with pytest.raises(AssertionError, match=r"repeat 3 took 4.00 s at best \(tries \[5.0, 4.0, 6.0\]\)"):
        slow = iter([4.0, 6.0])
        traffic.check_repeat_times([0.2, 0.25, 5.0], lambda: next(slow), "fallback")
    calls = []
    assert traffic.check_repeat_times([0.2, 3.1, 0.3], lambda: calls.append(1) or 0.1, "within the bound") == 0
    assert calls == []
