# moefuse: `make` builds the library and programs, `make test` runs the tests
# (`make test-c`: the C tests and the fuzzers, `make test-python`: the Python tests),
# `make run` runs the main job (one training step checked against the reference),
# `make bench` runs the benchmarks. CUDA sources are compiled for sm_90a whenever
# nvcc is found (NVCC=none to build without).
#
# A build follows its flags: a build with CUDA goes to build/, one without to build/cpu/
# (so switching costs no recompilation), and each directory records the flags its
# objects were compiled with (flags.host, flags.cuda): a change of compiler or flags
# rebuilds what they compiled. NVCC_EXTRA adds nvcc flags (e.g. a macro that selects an
# opt-in kernel path, -DNAME=1).

CC      ?= cc
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
PYTHON  ?= python3

OPENBLAS_INC := $(firstword $(wildcard /usr/include/x86_64-linux-gnu/openblas-openmp \
                  /usr/include/aarch64-linux-gnu/openblas-openmp /usr/include/openblas))
CFLAGS  ?= -O2 -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC -fopenmp -Iinclude -Isrc/host \
           -Isrc/cpu $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC))
LDLIBS  := -lopenblas -lm -fopenmp

HOST_SRC := $(wildcard src/host/*.c) $(wildcard src/cpu/*.c) $(wildcard src/comm/*.c)
CUDA_SRC := $(shell find src/cuda -name '*.cu' | sort)
CUDA_HDR := $(shell find src/cuda -name '*.h' -o -name '*.cuh')

ifneq ($(NVCC),)
ifneq ($(NVCC),none)
HAVE_CUDA := 1
endif
endif

ifeq ($(HAVE_CUDA),1)
BUILD       := build
else
BUILD       := build/cpu
endif

ifeq ($(HAVE_CUDA),1)
CUDA_HOME   := $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH   := -gencode=arch=compute_90a,code=sm_90a
# NCCL (expert parallelism over a communicator): the headers and the libnccl that will be
# loaded, NCCL_HOME/include and NCCL_HOME/lib (PyTorch's: site-packages/nvidia/nccl);
# else the toolkit's. Built in when nccl_device.h (NCCL >= 2.28) and a libnccl are there.
NCCL_HOME   ?= $(CUDA_HOME)
NCCL_LIB    := $(firstword $(wildcard $(NCCL_HOME)/lib/libnccl.so.2 $(NCCL_HOME)/lib64/libnccl.so.2))
ifneq ($(and $(wildcard $(NCCL_HOME)/include/nccl_device.h),$(NCCL_LIB)),)
HAVE_NCCL   := 1
CUDA_SRC    += $(wildcard src/comm/*.cu)
NCCL_LIBS   := -L$(dir $(NCCL_LIB)) -Wl,-rpath,$(dir $(NCCL_LIB)) -l:libnccl.so.2
endif
NVCCFLAGS   := -O3 -std=c++17 $(CUDA_ARCH) -lineinfo -Xptxas=--warn-on-spills \
               -Werror=all-warnings -Xcompiler -fPIC -Iinclude -Isrc/host -Isrc/cuda \
               $(if $(HAVE_NCCL),-I$(NCCL_HOME)/include -DMOEFUSE_HAVE_NCCL=1) $(NVCC_EXTRA)
CUDA_OBJ    := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
CUDA_LIBS   := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++ $(NCCL_LIBS)
CFLAGS      += $(if $(HAVE_NCCL),-I$(NCCL_HOME)/include -DMOEFUSE_HAVE_NCCL=1) \
               -DMOEFUSE_HAVE_CUDA=1 -I$(CUDA_HOME)/include
else
CUDA_OBJ    :=
CUDA_LIBS   :=
endif

# The flags records: rewritten (so newer than every object) only when the flags change.
HOST_FLAGS := $(CC) $(CFLAGS) $(LDLIBS) $(CUDA_LIBS)
CUDA_FLAGS := $(NVCC) $(NVCCFLAGS)
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),all)),)
$(shell mkdir -p $(BUILD))
ifneq ($(file <$(BUILD)/flags.host),$(HOST_FLAGS))
$(file >$(BUILD)/flags.host,$(HOST_FLAGS))
endif
ifneq ($(file <$(BUILD)/flags.cuda),$(CUDA_FLAGS))
$(file >$(BUILD)/flags.cuda,$(CUDA_FLAGS))
endif
endif
HOST_STAMP := $(BUILD)/flags.host
CUDA_STAMP := $(BUILD)/flags.cuda

HOST_OBJ := $(HOST_SRC:%.c=$(BUILD)/%.o)
LIB_OBJ  := $(HOST_OBJ) $(CUDA_OBJ)

# tests/cpu/ and tests/api/test_validation.c: always; tests/api/test_cuda_*.c (the CUDA
# backend through the public API) and tests/kernels/ (the kernels alone): with CUDA.
TEST_SRC  := $(wildcard tests/cpu/test_*.c) tests/api/test_validation.c
TEST_BIN  := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
GPU_TEST_SRC := $(wildcard tests/api/test_cuda_*.c) $(wildcard tests/kernels/test_*.cu)
GPU_TEST_BIN := $(if $(HAVE_CUDA),$(patsubst tests/%,$(BUILD)/tests/%,$(basename $(GPU_TEST_SRC))))
TOOLS     := $(BUILD)/moefuse_step
BENCH_BIN := $(if $(HAVE_CUDA),$(BUILD)/bench/bench_forward_cuda $(BUILD)/bench/bench_precision_cuda \
                             $(BUILD)/tools/output_hashes)

.SECONDARY:
.PHONY: all lib test test-c test-gpu test-python fuzz run bench clean
all: lib $(TOOLS) $(TEST_BIN) $(GPU_TEST_BIN) $(BENCH_BIN)
lib: $(BUILD)/libmoefuse.so $(BUILD)/libmoefuse.a

$(BUILD)/%.o: %.c $(wildcard include/*.h src/*/*.h tests/*.h) $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cu $(wildcard include/*.h src/host/*.h) $(CUDA_HDR) $(CUDA_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Xptxas=-v -c $< -o $@ 2> $@.ptxas.log || { cat $@.ptxas.log; exit 1; }
	@! grep -E "bytes spill (stores|loads)" $@.ptxas.log | grep -v " 0 bytes spill" \
	   || { echo "error: $< spills registers (see $@.ptxas.log)"; exit 1; }

$(BUILD)/libmoefuse.so: $(LIB_OBJ)
	$(CC) -shared -Wl,--no-undefined -o $@ $^ $(LDLIBS) $(CUDA_LIBS)

$(BUILD)/libmoefuse.a: $(LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

TEST_HARNESS := $(BUILD)/tests/harness.o $(BUILD)/tests/plan_check.o
TEST_HDR     := $(wildcard tests/*.h tests/api/*.h) include/moefuse.h src/host/internal.h
# The API tests' one fixture: tests/api/fixture.* (shapes, problems, poisoning, the
# reference comparison; tests/cpu/ uses it too) and, for the CUDA backend tests only,
# its device part tests/api/fixture_cuda.*. It calls the public API, so the kernel
# tests, which link only the kernels they test, leave it out.
FIXTURE      := $(BUILD)/tests/api/fixture.o
FIXTURE_CUDA := $(BUILD)/tests/api/fixture_cuda.o
$(BUILD)/tests/%.o: tests/%.c $(wildcard tests/*.h) include/moefuse.h src/host/internal.h \
                    $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -c $< -o $@

$(BUILD)/tests/api/%.o: tests/api/%.c $(TEST_HDR) $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Itests/api -c $< -o $@

# Static pattern rules (one rule a binary: two pattern rules that both match, as
# api/test_% and api/test_cuda_%, would leave the choice to make).
CPU_API_TEST_BIN  := $(TEST_BIN)
CUDA_API_TEST_BIN := $(if $(HAVE_CUDA),$(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/api/test_cuda_*.c)))
$(CPU_API_TEST_BIN): $(BUILD)/tests/%: tests/%.c $(TEST_HDR) $(TEST_HARNESS) $(FIXTURE) \
                     $(BUILD)/libmoefuse.a $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Itests/api $< $(filter %.o,$^) $(BUILD)/libmoefuse.a -o $@ \
	    $(LDLIBS) $(CUDA_LIBS)
$(CUDA_API_TEST_BIN): $(BUILD)/tests/%: tests/%.c $(TEST_HDR) $(TEST_HARNESS) $(FIXTURE_CUDA) \
                      $(BUILD)/libmoefuse.a $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Itests/api $< $(filter %.o,$^) $(BUILD)/libmoefuse.a -o $@ \
	    $(LDLIBS) $(CUDA_LIBS)
# The FP8 suite compares with the fp64 emulation through the host fixture's problems.
$(if $(HAVE_CUDA),$(BUILD)/tests/api/test_cuda_fp8): $(FIXTURE)
# tests/cpu/'s helpers (cpu_test_util.*, not named test_*): linked into each tests/cpu/ binary.
CPU_TEST_UTIL := $(BUILD)/tests/cpu/cpu_test_util.o
$(CPU_TEST_UTIL): tests/cpu/cpu_test_util.h
$(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/cpu/test_*.c)): $(CPU_TEST_UTIL) \
                                                                     tests/cpu/cpu_test_util.h
# A CUDA suite split over several binaries (test_cuda_<suite>.c, test_cuda_<suite>_*.c)
# also links its own part of the fixture, tests/api/cuda_<suite>*.c.
define API_SUITE_RULE
$$(patsubst tests/%.c,$$(BUILD)/tests/%,$$(wildcard tests/api/test_cuda_$(1).c \
                                                    tests/api/test_cuda_$(1)_*.c)): \
    $$(patsubst tests/%.c,$$(BUILD)/tests/%.o,$$(wildcard tests/api/cuda_$(1)*.c))
endef
$(foreach s,$(patsubst tests/api/cuda_%.c,%,$(filter-out %_ref.c,$(wildcard tests/api/cuda_*.c))),\
  $(eval $(call API_SUITE_RULE,$(s))))

# The kernel tests' helpers (not named test_*: they are no test of their own).
KERNEL_TEST_UTIL := $(BUILD)/tests/kernels/gemm_test_util.o
$(KERNEL_TEST_UTIL): tests/kernels/gemm_test_util.cu tests/kernels/gemm_test_util.h tests/harness.h \
                     src/cuda/kernels.h src/cuda/gemm_params.h $(CUDA_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Itests -c $< -o $@

$(BUILD)/tests/kernels/test_%: tests/kernels/test_%.cu tests/kernels/gemm_test_util.h \
                               $(KERNEL_TEST_UTIL) $(TEST_HARNESS) $(BUILD)/libmoefuse.a \
                               $(HOST_STAMP) $(CUDA_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Itests -Isrc/cpu $< $(KERNEL_TEST_UTIL) $(TEST_HARNESS) \
	    $(BUILD)/libmoefuse.a -o $@ -Xcompiler -fopenmp -lopenblas -lm

$(BUILD)/moefuse_step: tools/moefuse_step.c src/cpu/reference.h $(BUILD)/libmoefuse.a $(HOST_STAMP)
	$(CC) $(CFLAGS) $< $(BUILD)/libmoefuse.a -o $@ $(LDLIBS) $(CUDA_LIBS)

# Hashes of every output for fixed inputs (public header only): compare two builds.
$(BUILD)/tools/output_hashes: tools/output_hashes.c include/moefuse.h $(BUILD)/libmoefuse.a $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(BUILD)/libmoefuse.a -o $@ $(LDLIBS) $(CUDA_LIBS)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libmoefuse.a $(HOST_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Isrc/cuda $< $(BUILD)/libmoefuse.a -o $@ $(LDLIBS) $(CUDA_LIBS)

# ---- fuzzing: libFuzzer with clang, address and undefined-behaviour sanitizers ----
FUZZ_SECONDS ?= 20
$(BUILD)/fuzz/fuzz_%: tests/fuzz/fuzz_%.c tests/plan_check.c $(HOST_SRC) $(wildcard include/*.h src/*/*.h)
	@mkdir -p $(dir $@)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fopenmp -fsanitize=fuzzer,address,undefined \
	    -fno-sanitize-recover=all -Iinclude -Isrc/host -Isrc/cpu -Itests \
	    $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC)) $< tests/plan_check.c $(HOST_SRC) -o $@ -lopenblas -lm

FUZZ_BIN := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))
fuzz: $(FUZZ_BIN)
	@for f in $(FUZZ_BIN); do echo "== $$f ($(FUZZ_SECONDS) s)"; \
	  mkdir -p $(BUILD)/fuzz/corpus-$$(basename $$f); \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=0 $(BUILD)/fuzz/corpus-$$(basename $$f) \
	    2> $(BUILD)/fuzz/$$(basename $$f).log || { tail -40 $(BUILD)/fuzz/$$(basename $$f).log; exit 1; }; \
	  tail -2 $(BUILD)/fuzz/$$(basename $$f).log; done

# ---- tests ----
# The Python tests load the library of this build (MOEFUSE_LIB).
RUN_TESTS := MOEFUSE_LIB=$(abspath $(BUILD))/libmoefuse.so tools/run_tests.sh
test: all
	@$(MAKE) --no-print-directory fuzz
	@$(RUN_TESTS) $(TEST_BIN) $(GPU_TEST_BIN) tests/test_make.sh tests/test_step.sh

test-c: all
	@$(MAKE) --no-print-directory fuzz
	@$(RUN_TESTS) --no-python $(TEST_BIN) $(GPU_TEST_BIN) tests/test_make.sh tests/test_step.sh

test-python: lib
	@$(RUN_TESTS) --python-only

test-gpu: all
	@$(RUN_TESTS) $(GPU_TEST_BIN)

run: $(BUILD)/moefuse_step
	$(BUILD)/moefuse_step

bench: all
	@MOEFUSE_LIB=$(abspath $(BUILD))/libmoefuse.so tools/run_bench.sh

# build/ holds build/cpu/: `make clean` removes both, `make clean NVCC=none` the second.
clean:
	rm -rf $(BUILD)
