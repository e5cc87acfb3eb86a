package idemotel_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemotel"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Serve idem's metrics on /metrics through the OpenTelemetry Prometheus
// exporter: the store reports claims and completions, the middleware its
// requests.
func Example_prometheus() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idemotel")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := idemsqlite.Open(filepath.Join(dir, "idem.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		log.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer mp.Shutdown(ctx)
	tel, err := idemotel.New(idemotel.WithMeterProvider(mp))
	if err != nil {
		log.Fatal(err)
	}
	defer tel.Close()

	store, err := idem.New(idemsqlite.New(db), &idem.Config{Observer: tel.Observer()})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.New(store, &idemhttp.Config{Observe: tel.ObserveHTTP})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := mw.Tx(r.Context()); !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 { // the second is a retry, replayed
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"a"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "order-0000000001")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}

	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	scrape, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(scrape), "\n") {
		if strings.HasPrefix(line, "idem_claims_total{") || strings.HasPrefix(line, "idem_http_requests_total{") {
			name, _, _ := strings.Cut(line, "{")
			fields := strings.Fields(line)
			fmt.Println(name, label(line, "idem_outcome"), fields[len(fields)-1])
		}
	}
	// Unordered output:
	// idem_claims_total acquired 1
	// idem_claims_total replayed 1
	// idem_http_requests_total completed 1
	// idem_http_requests_total replayed 1
}

// label returns the value of label name in a Prometheus sample line.
func label(line, name string) string {
	_, rest, ok := strings.Cut(line, name+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}
