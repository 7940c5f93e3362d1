import json

import pytest

from sglang_spec.errors import SpecError
from sglang_spec.tree import AcceptanceProfile, TokenTree


def test_uniform_and_per_depth_rows(tmp_path):
    profile = AcceptanceProfile.from_obj({"rank_acceptance": [[0.7, 0.1], [0.5], [0.3, 0.2, 0.1]], "head": "x"})
    assert profile.max_rank == 3
    assert profile.row(1) == (0.7, 0.1, 0.0)
    assert profile.row(2) == (0.5, 0.0, 0.0)
    assert profile.row(9) == (0.3, 0.2, 0.1)  # the last row repeats
    assert profile.acceptance(1, 5) == 0.0
    path = tmp_path / "p.json"
    profile.to_json(path)
    again = AcceptanceProfile.from_json(path)
    assert again.rank_acceptance == profile.rank_acceptance and again.metadata == {"head": "x"}


def test_expected_accept_length_is_sequoia_F():
    profile = AcceptanceProfile.uniform([0.6, 0.2, 0.1, 0.05])
    chain = TokenTree.from_parents([-1, 0, 1, 2])
    assert profile.expected_accept_length(chain) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    star = TokenTree.from_parents([-1, 0, 0, 0])
    assert profile.expected_accept_length(star) == pytest.approx(1.9)


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"rank_acceptance": [0.5, -0.1]}, r"rank_acceptance\[1\] = -0.1 is negative"),
        ({"rank_acceptance": [0.7, 0.4]}, "sums to 1.100000 > 1"),
        ({"rank_acceptance": [[0.5], [0.9, 0.2]]}, r"rank_acceptance\[1\] sums to"),
        ({"rank_acceptance": []}, "non-empty list"),
        ({"rank_acceptance": [0.5, [0.1]]}, "mixes numbers and lists"),
        ({"rank_acceptance": [0.5, "x"]}, "not a finite number"),
        ({"acceptance": [0.5]}, "missing key 'rank_acceptance'"),
    ],
)
def test_bad_profiles_get_one_clear_line(obj, message):
    with pytest.raises(SpecError, match=message) as error:
        AcceptanceProfile.from_obj(obj)
    assert "\n" not in str(error.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read acceptance profile"):
        AcceptanceProfile.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        AcceptanceProfile.from_json(bad)
    (tmp_path / "ok.json").write_text(json.dumps({"rank_acceptance": [0.5]}))
    assert AcceptanceProfile.from_json(tmp_path / "ok.json").max_rank == 1
