/* A helper thread that lends a second core to one thread's work (helper.c). */
#ifndef TT_HELPER_H
#define TT_HELPER_H

#include <stdint.h>

typedef struct tt_helper tt_helper;

/* One item of a job: `worker` is 0 on the caller, 1 on the helper (for per-worker scratch). */
typedef void (*tt_item_fn)(void *ctx, int64_t item, int worker);

/* Run items 0..count-1 of fn, on the caller and, where it is awake, on `h` too; returns once
 * every item is done. With `h` NULL the caller runs them all, in order. */
void tt_helper_run(tt_helper *h, tt_item_fn fn, void *ctx, int64_t count);

#endif
