"""Hypothesis profiles of the fuzz suite (tests/test_fuzz.py), registered on import.

    .venv/bin/python -m pytest tests/test_fuzz.py            # ci: what `make test` runs
    .venv/bin/python -m pytest -p tests.hypothesis_profiles --hypothesis-profile=long \
        tests/test_fuzz.py                                   # long: on demand

ci draws the same 250 examples a test every run (derandomized: a failure in CI is one anyone
reproduces) and reports a failure as drawn (shrinking it can take minutes); long draws 5,000
fresh ones and shrinks what fails. `-p` loads this module before hypothesis reads
--hypothesis-profile (test modules, which import it too, load only later). No deadline: the
tests bound time themselves, and a loaded CI machine must not make them flaky.
"""

from hypothesis import HealthCheck, Phase, settings

_COMMON = {"deadline": None, "database": None,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example,
                                     HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=250, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("long", max_examples=5000, **_COMMON)
if settings.get_current_profile_name() == "default":
    settings.load_profile("ci")
