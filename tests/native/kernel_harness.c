/* Runs one call of the CPU kernels (cpu_kernels.c, compiled into this program) described on stdin and writes its
 * result to stdout: the kernel test harness for builds this machine cannot run itself (arm64 NEON under
 * qemu-aarch64). The Python side (tests/kernel_harness.py) reads the buffers a call would read from its own memory,
 * sends them, and writes the outputs back where the call would have written them.
 * Request: the function's name (32 bytes, NUL-padded), int32 n, then n arguments: 'i' int64, 'f' float64,
 * 'b' int64 length + bytes (an input buffer), 'o' int64 length (an output buffer, zero-filled), 'n' (NULL).
 * Reply: float64 return value, then every output buffer's bytes in argument order; exit 2 on a bad request. */
#include "../../deltafin/kernels/cpu_kernels.c"
#include <stdio.h>

#define MAXA 24
typedef union {
    int64_t i;
    double f;
    void *p;
} arg_t;

static int rd(void *p, size_t n) { return fread(p, 1, n, stdin) == n; }

/* A denormal product with FZ set in the OpenMP team and after it: 1 when df_ftz flushes it, reports its state,
 * and clears it again. */
__attribute__((noipa)) static float mul(float a, float b) { return a * b; }

static double ftz_check(void) {
    volatile float tiny = 1e-39f, one = 1.0f;
    const int off = df_ftz(-1, 0);
    df_ftz(1, 2);
    const int on = df_ftz(-1, 0);
    const float flushed = mul(tiny, one);
    df_ftz(0, 2);
    const float kept = mul(tiny, one);
    return off == 0 && on == 1 && flushed == 0.0f && kept != 0.0f && df_ftz(-1, 0) == 0;
}

int main(void) {
    char name[33] = {0};
    int32_t n;
    arg_t a[MAXA];
    char kind[MAXA];
    int64_t len[MAXA];
    if (!rd(name, 32) || !rd(&n, 4) || n < 0 || n > MAXA) return 2;
    for (int k = 0; k < n; k++) {
        if (!rd(&kind[k], 1)) return 2;
        len[k] = 0;
        a[k].p = NULL;
        if (kind[k] == 'i' && !rd(&a[k].i, 8)) return 2;
        if (kind[k] == 'f' && !rd(&a[k].f, 8)) return 2;
        if (kind[k] == 'b' || kind[k] == 'o') {
            if (!rd(&len[k], 8) || len[k] < 0) return 2;
            a[k].p = calloc((size_t)len[k] + 64, 1);
            if (!a[k].p || (kind[k] == 'b' && !rd(a[k].p, (size_t)len[k]))) return 2;
        }
    }
#define I(k) a[k].i
#define F(k) ((float)a[k].f)
#define P(k) a[k].p
    double rc = 0;
    if (!strcmp(name, "df_q4q8_mm"))
        rc = df_q4q8_mm(I(0), P(1), P(2), P(3), I(4), F(5), P(6), P(7), P(8), I(9), I(10), I(11), I(12));
    else if (!strcmp(name, "df_q4_mm"))
        df_q4_mm(I(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7), I(8), I(9), I(10), I(11));
    else if (!strcmp(name, "df_q4_decode"))
        df_q4_decode(I(0), P(1), P(2), P(3), P(4), P(5), I(6), I(7), I(8), I(9));
    else if (!strcmp(name, "df_i8_mm"))
        df_i8_mm(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    else if (!strcmp(name, "df_i8a16_mm"))
        rc = df_i8a16_mm(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    else if (!strcmp(name, "df_glu_act"))
        df_glu_act(I(0), F(1), F(2), P(3), P(4), P(5), I(6));
    else if (!strcmp(name, "df_q4q8_glu"))
        rc = df_q4q8_glu(I(0), F(1), F(2), I(3), P(4), P(5), P(6), P(7), P(8), P(9), P(10), I(11), F(12), P(13),
                         P(14), P(15), I(16), I(17), I(18), I(19));
    else if (!strcmp(name, "df_q4gw_mm"))
        rc = df_q4gw_mm(I(0), P(1), P(2), P(3), I(4), F(5), P(6), P(7), P(8), I(9), I(10), I(11), I(12));
    else if (!strcmp(name, "df_i8gw_mm"))
        rc = df_i8gw_mm(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    else if (!strcmp(name, "df_isa")) rc = df_isa();
    else if (!strcmp(name, "df_simd_width")) rc = df_simd_width();
    else if (!strcmp(name, "df_q8_vnni")) rc = df_q8_vnni();
    else if (!strcmp(name, "df_a16_vnni")) rc = df_a16_vnni();
    else if (!strcmp(name, "df_q4gw_vnni")) rc = df_q4gw_vnni();
    else if (!strcmp(name, "df_q8_terms")) rc = df_q8_terms();
    else if (!strcmp(name, "df_openmp")) rc = df_openmp();
    else if (!strcmp(name, "ftz_check")) rc = ftz_check();
    else return 2;
    fwrite(&rc, 8, 1, stdout);
    for (int k = 0; k < n; k++)
        if (kind[k] == 'o') fwrite(a[k].p, 1, (size_t)len[k], stdout);
    return 0;
}
