"""Tests. Hypothesis runs a modest number of examples by default (profile ``ci``);
``HYPOTHESIS_PROFILE=fuzz`` runs many more wherever a test does not fix its own count."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile(
    "fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
