package idemotel_test

import (
	"bufio"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemotel"
	"github.com/idemstore/idem/idemhttp"
)

func TestPrometheusScrape(t *testing.T) {
	dialects(t, testPrometheusScrape[*sql.Tx], testPrometheusScrape[pgx.Tx])
}

// testPrometheusScrape serves an orders endpoint protected by idemhttp,
// with idemotel behind the OpenTelemetry Prometheus exporter on /metrics,
// runs the scripted sequence over HTTP (1 order created, 2 replays, 1 key
// reused, 1 in progress, 1 outage) and finds its counts in the scrape.
func testPrometheusScrape[TTx any](t *testing.T, h harness[TTx]) {
	ctx := t.Context()
	ns := h.Open(t)

	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	require.NoError(t, err)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(ctx) })
	tel, err := idemotel.New(idemotel.WithMeterProvider(mp))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })

	store, err := idem.New(ns.Dialect, &idem.Config{Observer: tel.Observer()})
	require.NoError(t, err)
	down, err := idem.New(h.Unreachable(t), &idem.Config{Observer: tel.Observer(), WaitTimeout: time.Second})
	require.NoError(t, err)

	createOrder := func(w http.ResponseWriter, r *http.Request) {
		tx, ok := idemhttp.Tx[TTx](r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		id, err := ns.InsertOrder(r.Context(), tx, "acme", r.Header.Get("Idempotency-Key"), 1999)
		if err != nil {
			http.Error(w, "insert failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"id":%d}`, id)
	}
	mux := http.NewServeMux()
	wrap := func(store *idem.Store[TTx], cfg *idemhttp.Config) func(http.Handler) http.Handler {
		mw, err := idemhttp.New(store, cfg)
		require.NoError(t, err)
		return mw.Wrap
	}
	mux.Handle("POST /orders", wrap(store, &idemhttp.Config{Observe: tel.ObserveHTTP})(http.HandlerFunc(createOrder)))
	mux.Handle("POST /down/orders", wrap(down, &idemhttp.Config{Observe: tel.ObserveHTTP})(http.HandlerFunc(createOrder)))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	post := func(path, key, body string) int {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	const key, busy = "order-key-000001", "order-key-000002"
	require.Equal(t, http.StatusCreated, post("/orders", key, `{"sku":"a"}`))
	require.Equal(t, http.StatusCreated, post("/orders", key, `{"sku":"a"}`)) // replayed
	require.Equal(t, http.StatusCreated, post("/orders", key, `{"sku":"a"}`)) // replayed
	require.Equal(t, http.StatusConflict, post("/orders", key, `{"sku":"b"}`))
	// Another instance, not observed, holds busy's lease while its
	// handler works: the request is in progress.
	holder, err := idem.New(ns.Dialect, nil)
	require.NoError(t, err)
	entered, release := make(chan struct{}), make(chan struct{})
	other := http.NewServeMux()
	other.Handle("POST /orders", wrap(holder, &idemhttp.Config{Mode: idemhttp.Leased})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-release
			w.WriteHeader(http.StatusCreated)
		})))
	otherSrv := httptest.NewServer(other)
	t.Cleanup(otherSrv.Close)
	held := make(chan int, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, otherSrv.URL+"/orders", strings.NewReader(`{"sku":"c"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", busy)
		resp, err := otherSrv.Client().Do(req)
		if err != nil {
			held <- 0
			return
		}
		_ = resp.Body.Close()
		held <- resp.StatusCode
	}()
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the holder's handler did not start")
	}
	require.Equal(t, http.StatusConflict, post("/orders", busy, `{"sku":"c"}`))
	close(release)
	require.Equal(t, http.StatusCreated, <-held)
	require.Equal(t, http.StatusServiceUnavailable, post("/down/orders", key, `{"sku":"a"}`))
	n, err := ns.CountOrders(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	resp, err := srv.Client().Get(srv.URL + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	samples := parseProm(t, resp.Body)

	dialect := ns.Dialect.Name()
	for outcome, want := range map[string]float64{
		"acquired": 1, "replayed": 2, "mismatch": 1, "in_progress": 1, "store_unavailable": 1,
	} {
		require.Equal(t, want, samples.sum("idem_claims_total", "idem_outcome", outcome, "idem_dialect", dialect), outcome)
		require.Equal(t, want, samples.sum("idem_claim_duration_seconds_count", "idem_outcome", outcome), outcome)
	}
	require.Equal(t, 6.0, samples.sum("idem_claims_total"))
	require.Equal(t, 1.0, samples.sum("idem_completions_total", "idem_outcome", "stored", "idem_status", "succeeded"))
	require.Equal(t, 1.0, samples.sum("idem_response_size_bytes_count"))
	require.Equal(t, float64(len(`{"id":1}`)), samples.sum("idem_response_size_bytes_sum"))
	for outcome, want := range map[string]float64{
		"completed": 1, "replayed": 2, "key_reused": 1, "in_progress": 1, "store_unavailable": 1,
	} {
		require.Equal(t, want, samples.sum("idem_http_requests_total", "idem_outcome", outcome, "http_request_method", "POST"), outcome)
	}
	require.Equal(t, 5.0, samples.sum("idem_http_requests_total", "http_route", "/orders"))
	require.Equal(t, 1.0, samples.sum("idem_http_requests_total", "http_route", "/down/orders", "http_response_status_code", "503"))
}

type sample struct {
	name   string
	labels map[string]string
	value  float64
}

type promSamples []sample

var labelRE = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// parseProm reads the Prometheus text format's samples.
func parseProm(t *testing.T, r io.Reader) promSamples {
	t.Helper()
	var out promSamples
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s := sample{labels: map[string]string{}}
		head, val, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(line, '{'); i >= 0 {
			j := strings.LastIndexByte(line, '}')
			s.name = line[:i]
			for _, m := range labelRE.FindAllStringSubmatch(line[i+1:j], -1) {
				s.labels[m[1]] = m[2]
			}
			val = strings.TrimSpace(line[j+1:])
		} else {
			s.name = head
		}
		if f := strings.Fields(val); len(f) > 0 {
			v, err := strconv.ParseFloat(f[0], 64)
			require.NoError(t, err, line)
			s.value = v
		}
		out = append(out, s)
	}
	require.NoError(t, sc.Err())
	return out
}

// sum adds the values of name's samples whose labels match the pairs.
func (ps promSamples) sum(name string, pairs ...string) float64 {
	var total float64
next:
	for _, s := range ps {
		if s.name != name {
			continue
		}
		for i := 0; i+1 < len(pairs); i += 2 {
			if s.labels[pairs[i]] != pairs[i+1] {
				continue next
			}
		}
		total += s.value
	}
	return total
}
