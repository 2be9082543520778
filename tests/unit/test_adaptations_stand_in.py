"""adaptations/stand_in.install_stand_in: swap a module another module imported, once, and only where it is that
module."""

import json
import types

from adaptations.stand_in import install_stand_in


class Loud:
    def __getattr__(self, name):
        return getattr(json, name)

    def dumps(self, obj):
        return json.dumps(obj).upper()


def test_installs_once_and_delegates_the_rest():
    owner = types.ModuleType("owner")
    owner.json = json
    assert install_stand_in(owner, "json", json, Loud)
    first = owner.json
    assert install_stand_in(owner, "json", json, Loud) and owner.json is first  # idempotent: not wrapped twice
    assert owner.json.dumps({"a": "b"}) == '{"A": "B"}' and owner.json.loads("[1]") == [1]
    assert json.dumps({"a": "b"}) == '{"a": "b"}'  # the real module, elsewhere, unchanged


def test_an_owner_that_does_not_look_as_expected_is_left_alone():
    moved = types.ModuleType("moved")  # a release that no longer imports json here
    assert install_stand_in(moved, "json", json, Loud) is False and not hasattr(moved, "json")
    other = types.ModuleType("other")
    other.json = "something else"
    assert install_stand_in(other, "json", json, Loud) is False and other.json == "something else"
