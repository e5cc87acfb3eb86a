// Package idemotel reports what idem does as OpenTelemetry metrics and
// spans, from the store's [idem.Observer] hooks and the HTTP middleware's
// [idemhttp.Config.Observe]:
//
//	tel, err := idemotel.New(idemotel.WithMeterProvider(mp), idemotel.WithTracerProvider(tp))
//	store, err := idem.New(dialect, &idem.Config{Observer: tel.Observer()})
//	mw, err := idemhttp.New(store, &idemhttp.Config{Observe: tel.ObserveHTTP}) // then mw.Wrap(handler)
//
// # Metrics
//
//	idem.claims                  counter    {claim}       idem.outcome, idem.dialect[, idem.operation]
//	idem.claim.duration          histogram  s             idem.outcome, idem.dialect[, idem.operation]
//	idem.completions             counter    {completion}  idem.outcome, idem.status, idem.dialect[, idem.operation]
//	idem.completion.duration     histogram  s             idem.outcome, idem.status, idem.dialect[, idem.operation]
//	idem.response.size           histogram  By            idem.status, idem.dialect[, idem.operation] (stored responses)
//	idem.lease.events            counter    {event}       idem.lease.event, idem.dialect[, idem.operation]
//	idem.status_checks           counter    {check}       idem.verdict, idem.check.failed, idem.dialect[, idem.operation]
//	idem.status_check.duration   histogram  s             idem.verdict, idem.check.failed, idem.dialect[, idem.operation]
//	idem.reaper.deleted          counter    {record}      idem.dialect
//	idem.reaper.resolved         counter    {record}      idem.resolution, idem.dialect
//	idem.reaper.errors           counter    {error}       idem.dialect
//	idem.reaper.backlog          gauge      {record}      idem.dialect (see below)
//	idem.leases.stale            gauge      {lease}       idem.dialect (see below)
//	idem.http.requests           counter    {request}     idem.outcome, idem.mode, http.request.method, http.response.status_code[, http.route]
//	idem.http.request.duration   histogram  s             the same
//
// Outcomes are the constants of package idem ([idem.ClaimAcquired] and its
// siblings, [idem.CompleteStored] and its siblings) and the outcomes of
// [idemhttp.RequestEvent]. Every attribute has a bounded set of values: the
// scope, which holds the tenant, is never one. idem.operation appears only
// when [WithOperation] maps scopes to a bounded set of names; http.route
// only when the request matched a ServeMux pattern.
//
// The two gauges report exact counts with [WithStats] (a store's
// [idem.Stats]) or [WithGauges]. Otherwise they come from the reaper's last
// pass, per dialect: idem.reaper.backlog is then 1 when the pass
// stopped at its MaxBatches with expired records left, else 0, and
// idem.leases.stale the stale leases the pass found and did not settle.
// Without a reaper running they report nothing.
//
// # Spans
//
// idem.claim, idem.complete and idem.status_check, each a child of the span
// in the operation's context, with the attributes idem.key_digest (the
// digest idem's logs print, never the key), idem.dialect, idem.outcome (or
// idem.verdict) and idem.operation when mapped. They are recorded when the
// operation has ended, with its start time, so spans of the database
// driver run meanwhile are their siblings, not their children. A claim or
// completion that failed with an error other than the expected answers
// (store unavailable, fenced, error) has status Error.
package idemotel

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// ScopeName is the instrumentation scope of the meter and the tracer.
const ScopeName = "github.com/idemstore/idem/contrib/idemotel"

// Attribute keys.
const (
	AttrOutcome    = attribute.Key("idem.outcome")
	AttrDialect    = attribute.Key("idem.dialect")
	AttrOperation  = attribute.Key("idem.operation")
	AttrStatus     = attribute.Key("idem.status")
	AttrLeaseEvent = attribute.Key("idem.lease.event")
	AttrVerdict    = attribute.Key("idem.verdict")
	AttrFailed     = attribute.Key("idem.check.failed")
	AttrResolution = attribute.Key("idem.resolution")
	AttrMode       = attribute.Key("idem.mode")
	AttrKeyDigest  = attribute.Key("idem.key_digest")
	AttrAttempt    = attribute.Key("idem.attempt")
)

// Gauges are exact counts for the two gauges, such as a store's Stats
// gives (expired records awaiting the reaper, stale leases). Counting
// reads the whole table: keep the collection interval long on a big one.
type Gauges struct {
	Backlog     int64
	StaleLeases int64
}

// Option configures [New].
type Option func(*config)

type config struct {
	mp        metric.MeterProvider
	tp        trace.TracerProvider
	operation func(scope string) string
	gauges    func(ctx context.Context) (Gauges, error)
}

// WithMeterProvider sets the meter provider. Defaults to otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option { return func(c *config) { c.mp = mp } }

// WithTracerProvider sets the tracer provider. Defaults to otel.GetTracerProvider().
func WithTracerProvider(tp trace.TracerProvider) Option { return func(c *config) { c.tp = tp } }

// WithOperation maps a scope to a bounded operation name, reported as
// idem.operation on the store's metrics and spans. It must return few
// distinct values (every value is a time series): return a fixed name per
// endpoint, never something derived from the tenant. Defaults to none: no
// idem.operation attribute.
func WithOperation(f func(scope string) string) Option {
	return func(c *config) { c.operation = f }
}

// WithGauges makes the gauges report f's counts, read at each collection,
// instead of the reaper's last pass. An error skips that collection.
func WithGauges(f func(ctx context.Context) (Gauges, error)) Option {
	return func(c *config) { c.gauges = f }
}

// WithStats makes the gauges report a store's [idem.Stats], read at each
// collection: idem.reaper.backlog its Expired records, idem.leases.stale
// its StaleLeases. Stats reads the whole table, so keep the collection
// interval long on a big one. Pass a closure over the store, which is made
// after the Telemetry:
//
//	var store *idem.Store[pgx.Tx]
//	tel, err := idemotel.New(idemotel.WithStats(func(ctx context.Context) (*idem.Stats, error) { return store.Stats(ctx) }))
//	store, err = idem.New(dialect, &idem.Config{Observer: tel.Observer()})
func WithStats(f func(ctx context.Context) (*idem.Stats, error)) Option {
	return WithGauges(func(ctx context.Context) (Gauges, error) {
		st, err := f(ctx)
		if err != nil {
			return Gauges{}, err
		}
		return Gauges{Backlog: st.Expired, StaleLeases: st.StaleLeases}, nil
	})
}

// Telemetry turns idem's events into OpenTelemetry metrics and spans. It is
// safe for concurrent use; one Telemetry may observe several stores.
type Telemetry struct {
	cfg    config
	tracer trace.Tracer

	claims, completions, leaseEvents, checks          metric.Int64Counter
	reapDeleted, reapResolved, reapErrors, httpCounts metric.Int64Counter
	claimDur, completeDur, checkDur, httpDur          metric.Float64Histogram
	respSize                                          metric.Int64Histogram
	registration                                      metric.Registration

	mu   sync.Mutex
	last map[string]idem.ReapEvent // the last reaper pass, by dialect
}

// New returns a Telemetry with its instruments created on the meter
// provider's meter.
func New(opts ...Option) (*Telemetry, error) {
	var c config
	for _, o := range opts {
		o(&c)
	}
	if c.mp == nil {
		c.mp = otel.GetMeterProvider()
	}
	if c.tp == nil {
		c.tp = otel.GetTracerProvider()
	}
	m := c.mp.Meter(ScopeName)
	t := &Telemetry{cfg: c, tracer: c.tp.Tracer(ScopeName), last: map[string]idem.ReapEvent{}}
	var errs []error
	counter := func(name, unit, desc string) metric.Int64Counter {
		i, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return i
	}
	seconds := func(name, desc string) metric.Float64Histogram {
		i, err := m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
			metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
		errs = append(errs, err)
		return i
	}
	t.claims = counter("idem.claims", "{claim}", "Claims of idempotency keys, by outcome.")
	t.claimDur = seconds("idem.claim.duration", "Duration of claims, by outcome.")
	t.completions = counter("idem.completions", "{completion}", "Completion statements, by outcome and stored status.")
	t.completeDur = seconds("idem.completion.duration", "Duration of completion statements.")
	var err error
	t.respSize, err = m.Int64Histogram("idem.response.size", metric.WithUnit("By"),
		metric.WithDescription("Size of stored response bodies."),
		metric.WithExplicitBucketBoundaries(64, 256, 1024, 4096, 16384, 65536, 262144, 1048576))
	errs = append(errs, err)
	t.leaseEvents = counter("idem.lease.events", "{event}", "Lease renewals, failed renewals, losses and takeovers.")
	t.checks = counter("idem.status_checks", "{check}", "Status checks of stale leases, by verdict.")
	t.checkDur = seconds("idem.status_check.duration", "Duration of status checks.")
	t.reapDeleted = counter("idem.reaper.deleted", "{record}", "Records deleted by the reaper after their retention.")
	t.reapResolved = counter("idem.reaper.resolved", "{record}", "Stale leases the reaper met, by resolution.")
	t.reapErrors = counter("idem.reaper.errors", "{error}", "Failed statements of reaper passes.")
	t.httpCounts = counter("idem.http.requests", "{request}", "Requests protected by the idemhttp middleware, by outcome.")
	t.httpDur = seconds("idem.http.request.duration", "Duration of protected requests, from arrival to answer.")
	backlog, err := m.Int64ObservableGauge("idem.reaper.backlog", metric.WithUnit("{record}"),
		metric.WithDescription("Expired records awaiting the reaper (without exact counts: 1 when its last pass was cut short, else 0)."))
	errs = append(errs, err)
	stale, err := m.Int64ObservableGauge("idem.leases.stale", metric.WithUnit("{lease}"),
		metric.WithDescription("Processing records whose lease ran out and that are not settled yet."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	t.registration, err = m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		return t.observeGauges(ctx, o, backlog, stale)
	}, backlog, stale)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// Close unregisters the gauges' callback.
func (t *Telemetry) Close() error { return t.registration.Unregister() }

func (t *Telemetry) observeGauges(ctx context.Context, o metric.Observer, backlog, stale metric.Int64ObservableGauge) error {
	if t.cfg.gauges != nil {
		g, err := t.cfg.gauges(ctx)
		if err != nil {
			return err
		}
		o.ObserveInt64(backlog, g.Backlog)
		o.ObserveInt64(stale, g.StaleLeases)
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for dialect, e := range t.last {
		attrs := metric.WithAttributes(AttrDialect.String(dialect))
		behind := int64(0)
		if e.Behind {
			behind = 1
		}
		o.ObserveInt64(backlog, behind, attrs)
		o.ObserveInt64(stale, int64(e.StaleLeft), attrs)
	}
	return nil
}

// Observer returns the hooks to set as idem.Config.Observer.
func (t *Telemetry) Observer() *idem.Observer {
	return &idem.Observer{
		Operation:   t.cfg.operation,
		Claim:       t.claim,
		Complete:    t.complete,
		Lease:       t.lease,
		StatusCheck: t.statusCheck,
		Reap:        t.reap,
	}
}

func base(dialect, operation string, extra ...attribute.KeyValue) []attribute.KeyValue {
	attrs := append(make([]attribute.KeyValue, 0, len(extra)+2), extra...)
	attrs = append(attrs, AttrDialect.String(dialect))
	if operation != "" {
		attrs = append(attrs, AttrOperation.String(operation))
	}
	return attrs
}

// span records an ended span named name that began latency ago.
func (t *Telemetry) span(ctx context.Context, name string, latency time.Duration, failed bool, attrs []attribute.KeyValue, keyDigest string) {
	end := time.Now()
	_, sp := t.tracer.Start(ctx, name, trace.WithTimestamp(end.Add(-latency)), trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(attrs...), trace.WithAttributes(AttrKeyDigest.String(keyDigest)))
	if failed {
		sp.SetStatus(codes.Error, "")
	}
	sp.End(trace.WithTimestamp(end))
}

func (t *Telemetry) claim(ctx context.Context, e idem.ClaimEvent) {
	attrs := base(e.Dialect, e.Operation, AttrOutcome.String(string(e.Outcome)))
	set := metric.WithAttributes(attrs...)
	t.claims.Add(ctx, 1, set)
	t.claimDur.Record(ctx, e.Latency.Seconds(), set)
	failed := e.Outcome == idem.ClaimStoreUnavailable || e.Outcome == idem.ClaimError
	if e.Attempt > 0 {
		attrs = append(attrs, AttrAttempt.Int(e.Attempt))
	}
	t.span(ctx, "idem.claim", e.Latency, failed, attrs, e.KeyDigest)
}

func (t *Telemetry) complete(ctx context.Context, e idem.CompleteEvent) {
	attrs := base(e.Dialect, e.Operation, AttrOutcome.String(string(e.Outcome)), AttrStatus.String(e.Status.String()))
	set := metric.WithAttributes(attrs...)
	t.completions.Add(ctx, 1, set)
	t.completeDur.Record(ctx, e.Latency.Seconds(), set)
	if e.Outcome == idem.CompleteStored {
		t.respSize.Record(ctx, int64(e.ResponseBytes),
			metric.WithAttributes(base(e.Dialect, e.Operation, AttrStatus.String(e.Status.String()))...))
	}
	t.span(ctx, "idem.complete", e.Latency, e.Outcome != idem.CompleteStored, attrs, e.KeyDigest)
}

func (t *Telemetry) lease(ctx context.Context, e idem.LeaseEvent) {
	t.leaseEvents.Add(ctx, 1, metric.WithAttributes(base(e.Dialect, e.Operation, AttrLeaseEvent.String(string(e.Kind)))...))
}

func (t *Telemetry) statusCheck(ctx context.Context, e idem.StatusCheckEvent) {
	attrs := base(e.Dialect, e.Operation, AttrVerdict.String(verdict(e.Verdict)), AttrFailed.Bool(e.Failed))
	set := metric.WithAttributes(attrs...)
	t.checks.Add(ctx, 1, set)
	t.checkDur.Record(ctx, e.Latency.Seconds(), set)
	t.span(ctx, "idem.status_check", e.Latency, e.Failed, append(attrs, AttrAttempt.Int(e.Attempt)), e.KeyDigest)
}

// verdict names a verdict as an attribute value, without spaces.
func verdict(k idem.VerdictKind) string {
	switch k {
	case idem.VerdictCommitted:
		return "committed"
	case idem.VerdictNotCommitted:
		return "not_committed"
	default:
		return "unknown"
	}
}

func (t *Telemetry) reap(ctx context.Context, e idem.ReapEvent) {
	dialect := AttrDialect.String(e.Dialect)
	t.reapDeleted.Add(ctx, int64(e.Report.Deleted), metric.WithAttributes(dialect))
	for _, r := range []struct {
		name string
		n    int
	}{
		{"finalised", e.Report.Finalised}, {"handed_over", e.Report.HandedOver},
		{"unknown", e.Report.Unknown}, {"unresolved", e.Report.Unresolved},
	} {
		if r.n > 0 {
			t.reapResolved.Add(ctx, int64(r.n), metric.WithAttributes(dialect, AttrResolution.String(r.name)))
		}
	}
	if e.Report.Errors > 0 {
		t.reapErrors.Add(ctx, int64(e.Report.Errors), metric.WithAttributes(dialect))
	}
	t.mu.Lock()
	t.last[e.Dialect] = e
	t.mu.Unlock()
}

// ObserveHTTP records one request of the idemhttp middleware; set it as
// idemhttp.Config.Observe.
func (t *Telemetry) ObserveHTTP(ctx context.Context, e idemhttp.RequestEvent) {
	attrs := make([]attribute.KeyValue, 0, 5)
	attrs = append(attrs,
		AttrOutcome.String(e.Outcome),
		AttrMode.String(e.Mode.String()),
		attribute.String("http.request.method", e.Method),
		attribute.Int("http.response.status_code", e.Status),
	)
	if e.Route != "" {
		attrs = append(attrs, attribute.String("http.route", e.Route))
	}
	set := metric.WithAttributes(attrs...)
	t.httpCounts.Add(ctx, 1, set)
	t.httpDur.Record(ctx, e.Latency.Seconds(), set)
}
