/*
 * flatsse: a fixed-latency, OpenAI-shaped completion upstream for proxy benchmarks.
 *
 * The Python simulator at 200 streams of the h100-8b profile writes ~16,700 SSE events a second and runs
 * ~75 % of a core doing it; its event loop then falls behind by tens of milliseconds now and then, and the
 * direct run's TTFT p50 moves between 31 and 66 ms from one repetition to the next (bench/gateway/README
 * section "Harness noise"). A proxy's added latency of a millisecond or two cannot be read through that.
 * This server does the same job in a few percent of a core: one thread, epoll, a heap of absolute
 * deadlines (a late tick does not push the later ones back), a write per event.
 *
 *   POST /v1/completions, /v1/chat/completions: a body with "stream": true -> text/event-stream: the first event after --ttft-ms, then
 *                    one every --itl-ms, --tokens in all, a usage event when the body asks for
 *                    "include_usage", then [DONE]; otherwise the whole answer (with usage) at the time the
 *                    last token would have been sent.
 *   GET /health      200, empty.
 *   GET /metrics     the vLLM gauges a router reads (running = streams in flight).
 *   GET /v1/models   the one model.
 *   anything else    404, as vLLM answers it.
 *
 * Build: cc -O2 -o flatsse flatsse.c    Run: flatsse PORT MODEL TTFT_MS ITL_MS TOKENS
 * Listens on 127.0.0.1 only. Benchmarks only: no TLS, no request validation beyond framing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXFD 65536
#define INBUF 65536

typedef struct {
    int fd;
    uint32_t gen;           /* bumps on close: stale timers are ignored */
    char in[INBUF + 1];     /* NUL-terminated */
    size_t inlen;
    char *out;              /* bytes the socket did not take yet */
    size_t outlen, outcap;
    int busy;               /* a request is being answered */
    int stream, usage, sent, keep;
    uint64_t start, next;   /* ns */
    unsigned long id;
} conn_t;

typedef struct {
    uint64_t at;
    int fd;
    uint32_t gen;
} timer_t_;

static conn_t *conns[MAXFD];
static timer_t_ *heap;
static size_t heaplen, heapcap;
static int ep;
static const char *model;
static uint64_t ttft_ns, itl_ns;
static int tokens;
static long running;
static unsigned long ids;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void heap_push(uint64_t at, int fd, uint32_t gen) {
    if (heaplen == heapcap) {
        heapcap = heapcap ? heapcap * 2 : 1024;
        heap = realloc(heap, heapcap * sizeof *heap);
        if (!heap) abort();
    }
    size_t i = heaplen++;
    while (i && heap[(i - 1) / 2].at > at) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = (timer_t_){at, fd, gen};
}

static timer_t_ heap_pop(void) {
    timer_t_ top = heap[0], last = heap[--heaplen];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= heaplen) break;
        if (c + 1 < heaplen && heap[c + 1].at < heap[c].at) c++;
        if (heap[c].at >= last.at) break;
        heap[i] = heap[c];
        i = c;
    }
    if (heaplen) heap[i] = last;
    return top;
}

static void drop(conn_t *c) {
    if (c->busy) running--;
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    conns[c->fd] = NULL;
    free(c->out);
    free(c);
}

static int flush_out(conn_t *c) {
    while (c->outlen) {
        ssize_t n = write(c->fd, c->out, c->outlen);
        if (n < 0) {
            if (errno == EAGAIN) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.fd = c->fd};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                return 0;
            }
            return -1;
        }
        memmove(c->out, c->out + n, c->outlen - (size_t)n);
        c->outlen -= (size_t)n;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = c->fd};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
    return 0;
}

/* Write now, or queue what the socket does not take. */
static int emit(conn_t *c, const char *buf, size_t len) {
    if (!c->outlen) {
        ssize_t n = write(c->fd, buf, len);
        if (n < 0 && errno != EAGAIN) return -1;
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
        }
        if (!len) return 0;
    }
    if (c->outlen + len > c->outcap) {
        c->outcap = (c->outlen + len) * 2;
        c->out = realloc(c->out, c->outcap);
        if (!c->out) abort();
    }
    memcpy(c->out + c->outlen, buf, len);
    c->outlen += len;
    return flush_out(c);
}

static int respond(conn_t *c, const char *status, const char *type, const char *body, size_t len) {
    char head[512];
    int h = snprintf(head, sizeof head,
                     "HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %zu\r\n%s\r\n", status, type, len,
                     c->keep ? "" : "connection: close\r\n");
    char *buf = malloc((size_t)h + len);
    if (!buf) abort();
    memcpy(buf, head, (size_t)h);
    memcpy(buf + h, body, len);
    int rc = emit(c, buf, (size_t)h + len);
    free(buf);
    return rc;
}

static int usage_json(char *buf, size_t cap) {
    return snprintf(buf, cap,
                    "\"usage\":{\"prompt_tokens\":6,\"total_tokens\":%d,\"completion_tokens\":%d,"
                    "\"prompt_tokens_details\":{\"cached_tokens\":0}}",
                    6 + tokens, tokens);
}

/* The next piece of an answer whose deadline has come. Returns -1 when the connection must go. */
static int tick(conn_t *c) {
    char ev[1024], usage[256], chunk[2048];
    if (!c->stream) {
        usage_json(usage, sizeof usage);
        char body[8192];
        size_t off = (size_t)snprintf(body, sizeof body,
                                      "{\"id\":\"cmpl-flat%lu\",\"object\":\"text_completion\",\"created\":0,"
                                      "\"model\":\"%s\",\"choices\":[{\"index\":0,\"text\":\"",
                                      c->id, model);
        for (int i = 0; i < tokens && off + 64 < sizeof body; i++) off += (size_t)snprintf(body + off, 8, " tok");
        off += (size_t)snprintf(body + off, sizeof body - off,
                                "\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],%s}",
                                usage);
        c->busy = 0;
        running--;
        return respond(c, "200 OK", "application/json", body, off);
    }
    size_t off = 0;
    if (c->sent == 0)
        off = (size_t)snprintf(chunk, sizeof chunk,
                               "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                               "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n%s\r\n",
                               c->keep ? "" : "connection: close\r\n");
    int last = c->sent == tokens - 1;
    int n = snprintf(ev, sizeof ev,
                     "data: {\"id\":\"cmpl-flat%lu\",\"object\":\"text_completion\",\"created\":0,\"model\":\"%s\","
                     "\"choices\":[{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":%s}]}\n\n",
                     c->id, model, last ? "\"length\",\"stop_reason\":null" : "null");
    if (last && c->usage) {
        usage_json(usage, sizeof usage);
        n += snprintf(ev + n, sizeof ev - (size_t)n,
                      "data: {\"id\":\"cmpl-flat%lu\",\"object\":\"text_completion\",\"created\":0,"
                      "\"model\":\"%s\",\"choices\":[],%s}\n\n",
                      c->id, model, usage);
    }
    if (last) n += snprintf(ev + n, sizeof ev - (size_t)n, "data: [DONE]\n\n");
    off += (size_t)snprintf(chunk + off, sizeof chunk - off, "%x\r\n%.*s\r\n%s", n, n, ev, last ? "0\r\n\r\n" : "");
    c->sent++;
    if (last) {
        c->busy = 0;
        running--;
    } else {
        c->next += itl_ns;
        heap_push(c->next, c->fd, c->gen);
    }
    return emit(c, chunk, off);
}

static int handle_get(conn_t *c, const char *path) {
    char body[2048];
    int n;
    if (!strcmp(path, "/health")) return respond(c, "200 OK", "text/plain", "", 0);
    if (!strcmp(path, "/metrics")) {
        n = snprintf(body, sizeof body,
                     "vllm:num_requests_running{model_name=\"%s\"} %ld\n"
                     "vllm:num_requests_waiting{model_name=\"%s\"} 0\n"
                     "vllm:gpu_cache_usage_perc{model_name=\"%s\"} 0.0\n"
                     "vllm:kv_cache_usage_perc{model_name=\"%s\"} 0.0\n",
                     model, running, model, model, model);
        return respond(c, "200 OK", "text/plain; version=0.0.4", body, (size_t)n);
    }
    if (!strcmp(path, "/v1/models")) {
        n = snprintf(body, sizeof body,
                     "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\",\"created\":0,"
                     "\"owned_by\":\"vllm\",\"root\":\"%s\",\"parent\":null,\"max_model_len\":4096}]}",
                     model, model);
        return respond(c, "200 OK", "application/json", body, (size_t)n);
    }
    return respond(c, "404 Not Found", "application/json", "{\"detail\":\"Not Found\"}", 22);
}

/* Parse whole requests out of the input buffer; answer GETs at once and schedule POSTs. */
static int on_input(conn_t *c) {
    while (!c->busy && c->inlen) {
        char *end = memmem(c->in, c->inlen, "\r\n\r\n", 4);
        if (!end) return c->inlen == INBUF ? -1 : 0;
        size_t headlen = (size_t)(end - c->in) + 4;
        size_t body = 0;
        c->keep = 1;
        for (char *line = strstr(c->in, "\r\n"); line && line < end; line = strstr(line + 2, "\r\n")) {
            if (!strncasecmp(line + 2, "content-length:", 15)) body = strtoul(line + 17, NULL, 10);
            if (!strncasecmp(line + 2, "connection:", 11)) {
                char *eol = strstr(line + 2, "\r\n"), *word = strcasestr(line + 13, "close");
                if (word && word < eol) c->keep = 0;
            }
        }
        if (headlen + body > INBUF) return -1;
        if (c->inlen < headlen + body) return 0;
        char method[8] = {0}, path[256] = {0};
        if (sscanf(c->in, "%7s %255s", method, path) != 2) return -1;
        char *b = c->in + headlen;
        int generate = !strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions");
        if (!strcmp(method, "POST") && !generate) {
            /* e.g. vllm-router's /v1/completions/render: answered as the simulator does */
            if (respond(c, "404 Not Found", "application/json", "{\"detail\":\"Not Found\"}", 22) < 0) return -1;
        } else if (!strcmp(method, "POST")) {
            c->stream = memmem(b, body, "\"stream\":true", 13) || memmem(b, body, "\"stream\": true", 14);
            c->usage = memmem(b, body, "\"include_usage\":true", 20) || memmem(b, body, "\"include_usage\": true", 21);
            c->busy = 1;
            c->sent = 0;
            c->id = ++ids;
            running++;
            c->start = now_ns();
            c->next = c->start + ttft_ns + (c->stream ? 0 : itl_ns * (uint64_t)(tokens - 1));
            heap_push(c->next, c->fd, c->gen);
        } else if (handle_get(c, path) < 0) {
            return -1;
        }
        memmove(c->in, c->in + headlen + body, c->inlen - headlen - body);
        c->inlen -= headlen + body;
        c->in[c->inlen] = 0;
        if (!c->keep && !c->busy && !c->outlen) return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: flatsse PORT MODEL TTFT_MS ITL_MS TOKENS\n");
        return 2;
    }
    int port = atoi(argv[1]);
    model = argv[2];
    ttft_ns = (uint64_t)(atof(argv[3]) * 1e6);
    itl_ns = (uint64_t)(atof(argv[4]) * 1e6);
    tokens = atoi(argv[5]);
    if (port <= 0 || tokens <= 0) {
        fprintf(stderr, "flatsse: PORT and TOKENS must be positive\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(ls, (struct sockaddr *)&addr, sizeof addr) || listen(ls, 4096)) {
        perror("flatsse: bind/listen");
        return 1;
    }
    ep = epoll_create1(0);
    struct epoll_event lev = {.events = EPOLLIN, .data.fd = ls};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &lev);
    struct epoll_event evs[256];
    for (;;) {
        struct timespec to, *top = NULL;
        if (heaplen) {
            uint64_t now = now_ns(), at = heap[0].at;
            uint64_t wait = at > now ? at - now : 0;
            to.tv_sec = (time_t)(wait / 1000000000ull);
            to.tv_nsec = (long)(wait % 1000000000ull);
            top = &to;
        }
        int n = epoll_pwait2(ep, evs, 256, top, NULL);
        if (n < 0 && errno != EINTR) {
            perror("flatsse: epoll");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int cfd;
                while ((cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    if (cfd >= MAXFD) {
                        close(cfd);
                        continue;
                    }
                    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *c = calloc(1, sizeof *c);
                    if (!c) abort();
                    static uint32_t gens;
                    c->fd = cfd;
                    c->gen = ++gens;
                    conns[cfd] = c;
                    struct epoll_event ev = {.events = EPOLLIN, .data.fd = cfd};
                    epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &ev);
                }
                continue;
            }
            conn_t *c = conns[fd];
            if (!c) continue;
            if ((evs[i].events & EPOLLOUT) && flush_out(c) < 0) {
                drop(c);
                continue;
            }
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                ssize_t r = read(fd, c->in + c->inlen, INBUF - c->inlen);
                if (r == 0 || (r < 0 && errno != EAGAIN)) {
                    drop(c);
                    continue;
                }
                if (r > 0) c->inlen += (size_t)r;
                c->in[c->inlen] = 0;
                if (on_input(c) < 0) drop(c);
            }
        }
        uint64_t now = now_ns();
        while (heaplen && heap[0].at <= now) {
            timer_t_ t = heap_pop();
            conn_t *c = conns[t.fd];
            if (!c || c->gen != t.gen || !c->busy) continue;
            if (tick(c) < 0 || (!c->busy && (!c->keep || on_input(c) < 0))) drop(c);
        }
    }
}
