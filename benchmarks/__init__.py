"""Benchmarks and the soak run: programs run by hand (`python -m benchmarks.<name>`), not by pytest.

They share the test suite's helpers (`tests.support`) to start the reference server and the service, so
they run from the repository root of a checkout with the test extra installed. They are not part of the
wheel (only app/ is). A small run of the throughput benchmark, the GPU benchmark's `--smoke` and the
soak's short mode are acceptance tests, so that the commands the documented figures come from keep working.
"""
