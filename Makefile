# Thin wrapper over CMake. `make demo` and `make test` are the two set-up commands.
#   make build            Release build in build/release
#   make test             build + every unit and integration test (ctest)
#   make test SANITIZE=1  the same under ASan+UBSan (build/asan)
#   make test SANITIZE=thread  the same under ThreadSanitizer (build/tsan; not in CI, see
#                         docs/contributing/architecture.md "Tests")
#   make demo             three simulated replicas + the proxy, a scripted tour, then serve
#   make bench            benchmarks against nginx and HAProxy (bench/RESULTS.md)
#   make valgrind         the integration tests with every `detproxy run` under memcheck
#                         (build/valgrind; VALGRIND_TESTS=regex narrows them)
#   make fuzz             libFuzzer targets for a bounded time (FUZZ_SECONDS, default 60)
#   make image            the container image (deploy/docker/Dockerfile) with podman
#                         (IMAGE, default localhost/detproxy:latest; scripts/image.sh); as root
#                         it sets podman up first (scripts/podman-setup.sh)
#   make image IMAGE_FROM=host  the same image from the binaries in build/release and the
#                         libraries they load: nothing from any archive
SANITIZE ?= 0
JOBS ?= $(shell nproc)
ifeq ($(SANITIZE),1)
BUILD ?= build/asan
CMAKE_FLAGS += -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_SANITIZE=ON
else ifeq ($(SANITIZE),thread)
BUILD ?= build/tsan
CMAKE_FLAGS += -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_TSAN=ON
else
BUILD ?= build/release
CMAKE_FLAGS += -DCMAKE_BUILD_TYPE=Release
endif
FUZZ_SECONDS ?= 60
# Quiet builds: no "Entering directory" lines from the make levels CMake nests, no echo of our
# own recipes; compiler errors and warnings still reach the terminal (they are on stderr).
MAKEFLAGS += --no-print-directory
QUIET_BUILD = -- --no-print-directory

.PHONY: all deps build test demo bench bench-quick fuzz image clean format valgrind
all: build

deps:
	@scripts/deps.sh

build: deps
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS) $(QUIET_BUILD)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Not part of `make test` (memcheck is ~20x slower); run now and then, and before a release.
VALGRIND_TESTS ?= .
VALGRIND_EXCLUDE ?= test_image|test_hostile_soak|test_resource_bounds|test_budget_return
valgrind: deps
	@command -v valgrind >/dev/null || apt-get install -y -q valgrind >/dev/null
	@cmake -S . -B build/valgrind -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_TESTS=OFF >/dev/null
	@cmake --build build/valgrind -j $(JOBS) $(QUIET_BUILD)
	@cd build/valgrind && DP_VALGRIND=1 ctest --output-on-failure -j $(JOBS) -L integration \
	  -R '$(VALGRIND_TESTS)' -E '$(VALGRIND_EXCLUDE)' --timeout 1200

demo: build
	@BUILD=$(BUILD) scripts/demo.sh

bench: build
	@BUILD=$(BUILD) bench/run.sh

bench-quick: build
	@BENCH_QUICK=1 BENCH_RESULTS=- BUILD=$(BUILD) bench/run.sh

fuzz: deps
	@CC=clang cmake -S . -B build/fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_FUZZ=ON -DDP_TESTS=OFF >/dev/null
	@cmake --build build/fuzz -j $(JOBS) --target fuzzers $(QUIET_BUILD)
	@FUZZ_SECONDS=$(FUZZ_SECONDS) tests/fuzz/run.sh build/fuzz

IMAGE_FROM ?= source
image:
	@IMAGE_FROM=$(IMAGE_FROM) BUILD=$(BUILD) scripts/image.sh

format:
	@git ls-files '*.c' '*.h' | xargs clang-format -i

clean:
	rm -rf build
