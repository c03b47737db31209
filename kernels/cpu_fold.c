/* The GDN fold of every layer in one call: each committed sequence's slot gets, in every GDN
 * layer, the recurrent state and the conv window after its last accepted verify row (the fold of
 * kernels/gdn_fold.py, whose docstring has the layouts and the rule). In torch the fold is four
 * small operations per layer (two gathers, two scatters); on a CPU each costs microseconds of
 * dispatch for a few kilobytes of copying, so a verify of a many-layer model spent far more on the
 * calls than on the bytes. Here it is a loop of copies.
 *
 * Per layer l: states_rows[l] with element strides (sb, sr) over [B, R] and the [H, Dk, Dv] state
 * of a row contiguous (row_elems elements); windows[l] [B, C, R, W] with element strides
 * (wb, wc, wr, ww); state[l] [S, row_elems] and conv[l] [S, C, W - 1] contiguous. Entry i copies
 * row rows[i] of batch entry batch[i] into slot slots[i] (columns 1..W-1 of the window). The rows
 * and the caches share a dtype of `item` bytes (2 or 4): the copy is exact.
 */
#include <stdint.h>
#include <string.h>

int fx_gdn_fold(int64_t layers, void *const *states_rows, void *const *windows, void *const *state,
                void *const *conv, int64_t n, const int64_t *batch, const int64_t *rows,
                const int64_t *slots, int64_t item, int64_t sb, int64_t sr, int64_t row_elems,
                int64_t wb, int64_t wc, int64_t wr, int64_t ww, int64_t channels, int64_t width) {
  if (item != 2 && item != 4) return 1;
  if (layers < 0 || n < 0 || row_elems < 0 || channels < 0 || width < 1) return 2;
  const int64_t cols = width - 1;
  for (int64_t l = 0; l < layers; ++l) {
    const char *src = (const char *)states_rows[l];
    const char *win = (const char *)windows[l];
    char *dst = (char *)state[l];
    char *cdst = (char *)conv[l];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = batch[i], r = rows[i], s = slots[i];
      memcpy(dst + s * row_elems * item, src + (b * sb + r * sr) * item, (size_t)(row_elems * item));
      char *out = cdst + s * channels * cols * item;
      const char *w0 = win + (b * wb + r * wr + ww) * item;  /* column 1 of the row's window */
      if (item == 2) {
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t j = 0; j < cols; ++j)
            ((uint16_t *)out)[c * cols + j] = *(const uint16_t *)(w0 + (c * wc + j * ww) * item);
      } else {
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t j = 0; j < cols; ++j)
            ((uint32_t *)out)[c * cols + j] = *(const uint32_t *)(w0 + (c * wc + j * ww) * item);
      }
    }
  }
  return 0;
}
