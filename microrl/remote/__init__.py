"""Deprecated: the out-of-process samplers moved to :mod:`microrl.rollout` (docs/changelog.md);
this re-export of its names goes in the next release."""

from microrl.rollout import moved_here

__getattr__ = moved_here(__name__)
