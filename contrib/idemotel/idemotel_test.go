package idemotel_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemotel"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/internal/storetest"
)

// dialects runs a test case on SQLite, PostgreSQL and MariaDB.
func dialects(t *testing.T, sqlCase func(*testing.T, harness[*sql.Tx]), pgCase func(*testing.T, harness[pgx.Tx])) {
	t.Helper()
	storetest.Dialects(t, storetest.InParallel, sqlCase, pgCase)
}

// telemetry is a Telemetry over an in-memory reader and span recorder.
type telemetry struct {
	tel    *idemotel.Telemetry
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
}

func newTelemetry(t *testing.T, opts ...idemotel.Option) *telemetry {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() {
		_ = mp.Shutdown(context.Background())
		_ = tp.Shutdown(context.Background())
	})
	tel, err := idemotel.New(append([]idemotel.Option{idemotel.WithMeterProvider(mp), idemotel.WithTracerProvider(tp)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tel.Close()) })
	return &telemetry{tel: tel, reader: reader, spans: spans, tp: tp}
}

func (x *telemetry) collect(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, x.reader.Collect(t.Context(), &rm))
	return rm
}

func find(rm metricdata.ResourceMetrics, name string) *metricdata.Metrics {
	for _, sm := range rm.ScopeMetrics {
		for i := range sm.Metrics {
			if sm.Metrics[i].Name == name {
				return &sm.Metrics[i]
			}
		}
	}
	return nil
}

// sums returns a counter's values by the value of attribute key, checking
// that every data point carries want.
func sums(t *testing.T, rm metricdata.ResourceMetrics, name string, key attribute.Key, want ...attribute.KeyValue) map[string]int64 {
	t.Helper()
	m := find(rm, name)
	require.NotNil(t, m, name)
	sum, ok := m.Data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is %T", name, m.Data)
	out := map[string]int64{}
	for _, dp := range sum.DataPoints {
		for _, kv := range want {
			v, ok := dp.Attributes.Value(kv.Key)
			require.True(t, ok, "%s lacks %s", name, kv.Key)
			require.Equal(t, kv.Value, v, "%s: %s", name, kv.Key)
		}
		v, _ := dp.Attributes.Value(key)
		out[v.Emit()] += dp.Value
	}
	return out
}

// counts returns a float histogram's counts by the value of key.
func counts(t *testing.T, rm metricdata.ResourceMetrics, name string, key attribute.Key) map[string]uint64 {
	t.Helper()
	m := find(rm, name)
	require.NotNil(t, m, name)
	h, ok := m.Data.(metricdata.Histogram[float64])
	require.True(t, ok, "%s is %T", name, m.Data)
	out := map[string]uint64{}
	for _, dp := range h.DataPoints {
		v, _ := dp.Attributes.Value(key)
		out[v.Emit()] += dp.Count
	}
	return out
}

func TestScriptedSequence(t *testing.T) {
	dialects(t, testScriptedSequence[*sql.Tx], testScriptedSequence[pgx.Tx])
}

// testScriptedSequence runs 1 acquire (completed), 2 replays, 1 mismatch,
// 1 in progress and 1 outage through Store.Claim under a parent span and
// checks the exact counts, histograms and spans.
func testScriptedSequence[TTx any](t *testing.T, h harness[TTx]) {
	ctx := t.Context()
	ns := h.Open(t)
	x := newTelemetry(t, idemotel.WithOperation(func(scope string) string {
		if strings.HasPrefix(scope, "orders/") {
			return "create_order"
		}
		return "other"
	}))
	store, err := idem.New(ns.Dialect, &idem.Config{Observer: x.tel.Observer()})
	require.NoError(t, err)
	holder, err := idem.New(ns.Dialect, nil) // not observed
	require.NoError(t, err)
	down, err := idem.New(h.Unreachable(t), &idem.Config{Observer: x.tel.Observer(), WaitTimeout: time.Second})
	require.NoError(t, err)

	ctx, parent := x.tp.Tracer("test").Start(ctx, "request")
	const scope = "orders/tenant-secret"
	fp, other := idem.NewFingerprint([]byte("a")), idem.NewFingerprint([]byte("b"))
	body := []byte(`{"order":"secret-body"}`)

	c, err := store.Claim(ctx, scope, "key-secret-1", fp)
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: 201, Body: body}))
	for range 2 {
		c, err := store.Claim(ctx, scope, "key-secret-1", fp)
		require.NoError(t, err)
		require.False(t, c.Acquired())
	}
	_, err = store.Claim(ctx, scope, "key-secret-1", other)
	require.ErrorIs(t, err, idem.ErrFingerprint)
	_, err = holder.Claim(ctx, scope, "key-secret-2", fp)
	require.NoError(t, err)
	_, err = store.Claim(ctx, scope, "key-secret-2", fp)
	require.ErrorIs(t, err, idem.ErrInProgress)
	_, err = down.Claim(ctx, scope, "key-secret-3", fp)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	parent.End()

	dialect := idemotel.AttrDialect.String(ns.Dialect.Name())
	operation := idemotel.AttrOperation.String("create_order")
	rm := x.collect(t)
	require.Equal(t, map[string]int64{
		"acquired": 1, "replayed": 2, "mismatch": 1, "in_progress": 1, "store_unavailable": 1,
	}, sums(t, rm, "idem.claims", idemotel.AttrOutcome, dialect, operation))
	require.Equal(t, map[string]uint64{
		"acquired": 1, "replayed": 2, "mismatch": 1, "in_progress": 1, "store_unavailable": 1,
	}, counts(t, rm, "idem.claim.duration", idemotel.AttrOutcome))
	require.Equal(t, map[string]int64{"stored": 1},
		sums(t, rm, "idem.completions", idemotel.AttrOutcome, dialect, operation, idemotel.AttrStatus.String("succeeded")))
	require.Equal(t, map[string]uint64{"stored": 1}, counts(t, rm, "idem.completion.duration", idemotel.AttrOutcome))
	size := find(rm, "idem.response.size")
	require.NotNil(t, size)
	hist := size.Data.(metricdata.Histogram[int64])
	require.Len(t, hist.DataPoints, 1)
	require.Equal(t, uint64(1), hist.DataPoints[0].Count)
	require.Equal(t, int64(len(body)), hist.DataPoints[0].Sum)

	// No attribute of any data point names the scope, a key or the body.
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			requireNoSecret(t, m.Name, attributesOf(m.Data))
		}
	}

	spans := x.spans.Ended()
	var claims, completes []sdktrace.ReadOnlySpan
	for _, s := range spans {
		switch s.Name() {
		case "idem.claim":
			claims = append(claims, s)
		case "idem.complete":
			completes = append(completes, s)
		}
		requireNoSecret(t, s.Name(), s.Attributes())
	}
	require.Len(t, claims, 6)
	require.Len(t, completes, 1)
	wantDigests := []string{
		digest.Key(scope, "key-secret-1"), digest.Key(scope, "key-secret-1"), digest.Key(scope, "key-secret-1"),
		digest.Key(scope, "key-secret-1"), digest.Key(scope, "key-secret-2"), digest.Key(scope, "key-secret-3"),
	}
	wantOutcomes := []string{"acquired", "replayed", "replayed", "mismatch", "in_progress", "store_unavailable"}
	for i, s := range claims {
		require.Equal(t, parent.SpanContext().SpanID(), s.Parent().SpanID(), "claim span %d nests under the caller's", i)
		require.Equal(t, wantDigests[i], attr(s, idemotel.AttrKeyDigest), i)
		require.Equal(t, wantOutcomes[i], attr(s, idemotel.AttrOutcome), i)
		require.False(t, s.EndTime().Before(s.StartTime()), i)
		require.True(t, !s.StartTime().Before(parentStart(spans)), i)
	}
	require.Equal(t, "Error", claims[5].Status().Code.String())
	require.Equal(t, "Unset", claims[1].Status().Code.String())
	require.Equal(t, digest.Key(scope, "key-secret-1"), attr(completes[0], idemotel.AttrKeyDigest))
}

func parentStart(spans []sdktrace.ReadOnlySpan) time.Time {
	for _, s := range spans {
		if s.Name() == "request" {
			return s.StartTime()
		}
	}
	return time.Time{}
}

func attr(s sdktrace.ReadOnlySpan, key attribute.Key) string {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

func attributesOf(data metricdata.Aggregation) []attribute.KeyValue {
	var out []attribute.KeyValue
	add := func(s attribute.Set) { out = append(out, s.ToSlice()...) }
	switch d := data.(type) {
	case metricdata.Sum[int64]:
		for _, dp := range d.DataPoints {
			add(dp.Attributes)
		}
	case metricdata.Histogram[float64]:
		for _, dp := range d.DataPoints {
			add(dp.Attributes)
		}
	case metricdata.Histogram[int64]:
		for _, dp := range d.DataPoints {
			add(dp.Attributes)
		}
	case metricdata.Gauge[int64]:
		for _, dp := range d.DataPoints {
			add(dp.Attributes)
		}
	}
	return out
}

func requireNoSecret(t *testing.T, where string, attrs []attribute.KeyValue) {
	t.Helper()
	for _, kv := range attrs {
		v := kv.Value.Emit()
		require.NotContains(t, v, "secret", "%s: %s", where, kv.Key)
	}
}
