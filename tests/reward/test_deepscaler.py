"""Tests for the deepscaler rule reward: boxed extraction and math-verify equivalence.

Uses the real math-verify (requirements.txt pin); no fakes.
"""

import threading

import pytest

from verl_patches.reward.deepscaler import compute_score, extract_last_boxed, normalize


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left\{ x \mid x^{2} > 1 \right\}}", r"\left\{ x \mid x^{2} > 1 \right\}"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5 is it", "5"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        ("no box here", None),
        (r"\boxed{unclosed", None),
        (r"\boxed{3} and a truncated \boxed{4", "3"),
        (r"\boxedfoo{9}", None),
        (r"\boxed{}", ""),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_extract_rejects_non_string():
    with pytest.raises(TypeError, match="response must be a str"):
        extract_last_boxed(None)


def test_normalize_spacing_and_dfrac():
    assert normalize(r"\dfrac{3}{4} .") == r"\frac{3}{4}"
    assert normalize(r"\left( 1 , 2 \right)") == "(1,2)"


@pytest.mark.parametrize(
    "response, truth, score",
    [
        (r"The answer is \boxed{42}.", "42", 1.0),
        (r"The answer is \boxed{41}.", "42", 0.0),
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{0.74}", "0.75", 0.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
        (r"\boxed{10\text{ cm}}", "10", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{2\pi}", r"2 \pi", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{(1,2)}", "(1, 2)", 1.0),
        (r"wrong \boxed{3} then corrected \boxed{4}", "4", 1.0),
        (r"correct \boxed{4} then wrong \boxed{3}", "4", 0.0),
        ("The answer is 42.", "42", 0.0),
        (r"\boxed{}", "0", 0.0),
        (r"\boxed{42}", r"\boxed{42}", 1.0),
        (r"\boxed{42}", 42, 1.0),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
        (r"\boxed{\{1,2\}}", r"\{1,3\}", 0.0),
    ],
)
def test_compute_score(response, truth, score):
    assert compute_score("deepscaler", response, truth) == score


def test_very_long_output_uses_last_box():
    filler = "Let us think step by step. " * 20000  # ~540k characters
    assert compute_score("deepscaler", filler + r"\boxed{17}", "17") == 1.0
    assert compute_score("deepscaler", r"\boxed{17}" + filler, "17") == 1.0
    assert compute_score("deepscaler", filler, "17") == 0.0


def test_huge_answer_is_not_sent_to_the_checker():
    big = "+".join(["1"] * 2000)
    assert compute_score("deepscaler", rf"\boxed{{{big}}}", "2000") == 0.0


def test_works_off_the_main_thread():
    # verl may score in a thread pool, where SIGALRM timeouts cannot be installed.
    out = []
    t = threading.Thread(target=lambda: out.append(compute_score("deepscaler", r"\boxed{0.5}", r"\frac12")))
    t.start()
    t.join()
    assert out == [1.0]


def test_bad_ground_truth_type_names_the_problem():
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("deepscaler", r"\boxed{1}", None)
