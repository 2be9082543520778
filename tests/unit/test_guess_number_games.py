"""bench.guess_number_games: the per-game figures, derived by hand for three games with secret 7."""

import json

from bench.guess_number_games import game_stats


def _game(secret, guesses):
    steps = [{"guess": g, "is_success": g == secret} for g in guesses]
    return {"label": str(secret), "env_info": json.dumps(steps)}


def test_binary_search_counting_and_a_deaf_game_by_hand():
    games = [
        _game(7, [5, 8, 6, 7]),  # Higher, Lower, Higher: each heeded, every guess still possible; won
        _game(7, [1, 2, 3, 4]),  # counting up: Higher x3 heeded; lost
        _game(7, [9, None, 9, 2]),  # Lower -> no number (not heard), then 9 again (not after a reply: last is 9)
    ]
    s = game_stats(games)
    assert s["games"] == 3 and s["win_rate"] == round(1 / 3, 4)
    assert s["count_up_win_rate"] == 0.0  # 7 > 4
    assert s["replies_with_a_number"] == round(11 / 12, 4)
    # after Higher: game 1 (5->8, 6->7), game 2 (1->2, 2->3, 3->4): 5 turns, all heeded
    assert (s["after_higher"], s["higher_heeded"]) == (5, 1.0)
    # after Lower: game 1 (8->6) heeded; game 3 (9->9 not lower, 9->2 lower): 3 turns, 2 heeded
    assert (s["after_lower"], s["lower_heeded"]) == (3, round(2 / 3, 4))
    # consistent: game 1 all 4; game 2 all 4 (1..4 are below 7 but each is above the last); game 3: 9 yes
    # (1..10), 9 again no (after Lower the range is 1..8), 2 yes -> 10 of 11
    assert s["consistent_guesses"] == round(10 / 11, 4)
    assert s["first_guesses"] == {"5": 1, "1": 1, "9": 1}
    assert s["wins_by_secret"] == {"7": "1/3"} and s["wins_above_4"] == 1
