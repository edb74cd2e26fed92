"""Deprecated: rollouts moved to :mod:`microrl.rollout` (docs/changelog.md); this re-export of
its names goes in the next release. The engine itself never imports sampling."""

from microrl.rollout import moved_here

__getattr__ = moved_here(__name__)
