/*
 * llama.cpp's own model loader, timed: one llama_model_load_from_file of a GGUF file onto
 * the CPU alone, in one load mode, with its log silenced. Built and run by bench/peers.py.
 *
 *     llama_load MODEL MODE
 *
 * MODE: none, mmap, mlock, mmap+mlock or direct-io. Model parameters: n_gpu_layers 0, no
 * extra buffer types (no repacking), no tensor checks, lazy reading off.
 *
 * Prints one JSON object: "load_s" the whole llama_model_load_from_file call, "tensors_s"
 * from the first to the last call of the progress callback (the load_all_data phase: it
 * starts after the file is parsed, mapped and the buffers are allocated, and ends when
 * progress 1.0 is reported), "progress_calls", "init_s" llama_backend_init, all from
 * CLOCK_MONOTONIC. Exit status 1 and "error" when the load fails, 2 on bad arguments.
 */

#define _POSIX_C_SOURCE 200809L

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "llama.h"

struct progress {
    double first;
    double last;
    float last_value;
    long calls;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec * 1e-9;
}

static void quiet(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level;
    (void) text;
    (void) user_data;
}

static bool on_progress(float value, void * user_data) {
    struct progress * p = (struct progress *) user_data;
    const double t = now();
    if (p->calls == 0) {
        p->first = t;
    }
    p->last = t;
    p->last_value = value;
    p->calls++;
    return true;
}

static int parse_mode(const char * name, enum llama_load_mode * mode) {
    static const struct {
        const char * name;
        enum llama_load_mode mode;
    } modes[] = {
        {"none", LLAMA_LOAD_MODE_NONE},
        {"mmap", LLAMA_LOAD_MODE_MMAP},
        {"mlock", LLAMA_LOAD_MODE_MLOCK},
        {"mmap+mlock", LLAMA_LOAD_MODE_MMAP_MLOCK},
        {"direct-io", LLAMA_LOAD_MODE_DIRECT_IO},
    };
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        if (strcmp(name, modes[i].name) == 0) {
            *mode = modes[i].mode;
            return 0;
        }
    }
    return -1;
}

int main(int argc, char ** argv) {
    enum llama_load_mode mode;
    if (argc != 3 || parse_mode(argv[2], &mode) != 0) {
        fprintf(stderr, "usage: %s MODEL none|mmap|mlock|mmap+mlock|direct-io\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);

    const double t_init = now();
    llama_backend_init();
    const double init_s = now() - t_init;

    struct progress p = {0};
    struct llama_model_params params = llama_model_default_params();
    params.n_gpu_layers = 0;
    params.load_mode = mode;
    params.lazy_mode = LLAMA_LAZY_MODE_OFF;
    params.use_extra_bufts = false;
    params.check_tensors = false;
    params.progress_callback = on_progress;
    params.progress_callback_user_data = &p;

    const double t0 = now();
    struct llama_model * model = llama_model_load_from_file(argv[1], params);
    const double load_s = now() - t0;

    if (model == NULL) {
        printf("{\"error\": \"llama_model_load_from_file failed\", \"load_s\": %.9f}\n", load_s);
        llama_backend_free();
        return 1;
    }
    const double tensors_s = p.calls > 0 ? p.last - p.first : 0.0;
    printf("{\"load_s\": %.9f, \"tensors_s\": %.9f, \"progress_calls\": %ld, \"progress_last\": %.6f, "
           "\"init_s\": %.9f, \"model_size\": %llu}\n",
           load_s, tensors_s, p.calls, (double) p.last_value, init_s,
           (unsigned long long) llama_model_size(model));
    fflush(stdout);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
