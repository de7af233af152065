# Developer shortcuts; CI runs .ci/run.
PY ?= python

.PHONY: compile debug test test-debug perf lint clean

compile:
	$(PY) setup.py build_ext --inplace -j 2

debug:
	CXLRT_DEBUG=1 $(PY) setup.py build_ext --inplace -j 2 --force

test: compile
	$(PY) -m pytest

test-debug: debug
	$(PY) -m pytest

perf: compile
	$(PY) -m pytest perf/ --benchmark-only

lint:
	ruff check cxlrt backends emulation tests perf

clean:
	rm -rf build *.egg-info .benchmarks cxlrt/layoutinfo_members.pxi
	find cxlrt backends emulation -name '*.so' -o -name '*.c' -o -name '*.html' | xargs rm -f
