"""Beam search's policy (disagg/api/beams.py) on hand-made top lists: which beams live, which end, their order."""

import math

import pytest

from disagg.api.beams import Beam, BeamParams, BeamSearch

EOS = 9


def search(width=2, max_tokens=3, **kw) -> BeamSearch:
    return BeamSearch(BeamParams(width, max_tokens, **kw), num_prompt_tokens=4, eos_token_ids=(EOS, 99))


def test_live_beams_are_the_best_candidates_of_every_beam():
    s = search()
    s.step([((1, -0.1), (2, -0.5), (3, -2.0), (4, -3.0))])
    assert [(b.token_ids, b.cum_logprob) for b in s.live] == [((1,), -0.1), ((2,), -0.5)]
    # Beam (2,)'s best continuation beats beam (1,)'s second one.
    s.step([((5, -1.0), (6, -1.2)), ((7, -0.2), (8, -2.0))])
    assert [(b.token_ids, round(b.cum_logprob, 6)) for b in s.live] == [((2, 7), -0.7), ((1, 5), -1.1)]
    assert s.live[0].steps == (((1, -0.1), (2, -0.5), (3, -2.0), (4, -3.0)), ((7, -0.2), (8, -2.0)))
    assert (s.num_steps, s.done) == (2, False)


def test_an_eos_candidate_finishes_its_beam_and_leaves_the_places_to_others():
    s = search(width=2)
    s.step([((EOS, -0.1), (1, -0.3), (2, -0.4), (3, -0.5))])
    assert [b.token_ids for b in s.live] == [(1,), (2,)]  # EOS took no live place
    assert s.finished == [Beam((), -0.1, (((EOS, -0.1), (1, -0.3), (2, -0.4), (3, -0.5)),), "stop", EOS)]
    kept = search(width=2, include_stop_str_in_output=True)
    kept.step([((99, -0.1), (1, -0.3))])
    assert kept.finished[0].token_ids == (99,) and kept.finished[0].stop_reason == 99
    ignored = search(width=2, ignore_eos=True)
    ignored.step([((EOS, -0.1), (1, -0.3))])
    assert ([b.token_ids for b in ignored.live], ignored.finished) == ([(EOS,), (1,)], [])


def test_best_ranks_by_length_normalised_score():
    s = search(width=2, max_tokens=2)
    s.step([((EOS, -1.0), (1, -0.2), (2, -0.3))])
    s.step([((3, -1.5), (4, -1.6)), ((5, -1.55), (6, -3.0))])
    assert s.done
    # Live: (1,3) -1.7 and (1,4) -1.8 ((2,5) -1.85 lost its place). Scores over the length with the
    # 4 prompt tokens: finished () -1.0/4, (1,3) -1.7/6, (1,4) -1.8/6.
    assert [(b.token_ids, b.finish_reason) for b in s.best()] == [((), "stop"), ((1, 3), None)]
    assert s.score(s.best()[1]) == pytest.approx(-1.7 / 6)
    # No length penalty: the raw sums (-1.0 against -1.7) keep the same order; a strong one reverses it.
    flat = search(width=2, max_tokens=2, length_penalty=0.0)
    flat.step([((EOS, -1.0), (1, -0.2), (2, -0.3))])
    flat.step([((3, -1.5), (4, -1.6)), ((5, -1.55), (6, -3.0))])
    assert flat.score(flat.best()[0]) == -1.0
    strong = search(width=2, max_tokens=2, length_penalty=3.0)
    strong.step([((EOS, -1.0), (1, -0.2), (2, -0.3))])
    strong.step([((3, -1.5), (4, -1.6)), ((5, -1.55), (6, -3.0))])
    assert [b.token_ids for b in strong.best()] == [(1, 3), (1, 4)]  # -1.7/216 and -1.8/216 beat -1.0/64


def test_a_final_eos_is_not_counted_in_the_length():
    s = search(width=1, include_stop_str_in_output=True, length_penalty=1.0)
    assert s.score(Beam((1, EOS), -2.0)) == -2.0 / 5
    assert s.score(Beam((1, 2), -2.0)) == -2.0 / 6


def test_the_search_ends_when_no_beam_is_live_or_at_max_tokens():
    s = search(width=1)
    s.step([((EOS, -0.5),)])
    assert s.done and s.live == [] and [b.finish_reason for b in s.best()] == ["stop"]
    assert search(max_tokens=0).done and search(max_tokens=0).best() == [Beam()]
    assert BeamParams(3, 5).num_logprobs == 6
    assert math.isclose(search().score(Beam((), 0.0)), 0.0)


def test_only_the_first_two_x_width_tokens_are_candidates_but_the_beam_keeps_the_whole_list():
    s = search(width=1)
    top = ((1, -0.1), (2, -0.2), (3, -0.3), (EOS, -0.4))  # EOS is fourth: no candidate at width 1
    s.step([top])
    assert ([b.token_ids for b in s.live], s.finished, s.live[0].steps) == ([(1,)], [], (top,))
