"""A site's report line says its DP budget unambiguously (issue 37, item 3)."""

from fedcontrast.site.report import format_row


def test_the_epsilon_line_says_this_round_and_spent_so_far_of_the_budget():
    row = {"round": 2, "rounds": 3, "accuracy": 0.8, "epsilon_round": 4.544, "epsilon_spent": 6.1, "epsilon_budget": 8}
    line = format_row(row, "hosp1")
    assert "ε this round 4.544 (its steps alone), spent so far 6.1 of budget 8" in line
    assert "of budget" not in format_row({**row, "epsilon_budget": None}, "hosp1")
