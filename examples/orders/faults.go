package main

import (
	"context"
	"io"
	"net/http"
	"os"

	"github.com/idemstore/idem"
)

// Fault injection is a TEST AID for the fault suite (faults/), off unless
// the service runs with -fault-injection. With it on, a request carrying
//
//	X-Fault-Crash: <stage>
//
// makes the process kill itself with SIGKILL (os.Process.Kill) at that
// stage, so that a test can crash it at an exact point instead of hoping a
// signal from outside lands there:
//
//	before-claim          before the idemhttp middleware: nothing is claimed
//	after-claim           POST /orders, inside the handler, after the order's
//	                      INSERT, before the transaction (claim + order) commits
//	after-commit          at the first WriteHeader or Write of the response,
//	                      which idemhttp sends only after the commit
//	before-provider-call  POST /payments, the lease committed, the provider not
//	                      called yet
//	during-provider-call  POST /payments, the provider has charged and
//	                      answered, the service has not recorded the charge
//	after-body-write      once the response's body object is written to the
//	                      body store (a response over -inline-body-max),
//	                      before the record naming it commits
//
// Nothing of this runs without the flag: the wrapper is not installed, and
// the hooks in the handlers find no stage in the context. Never enable it in
// production: any client could kill the process.
const crashHeader = "X-Fault-Crash"

// The crash stages of the X-Fault-Crash header.
const (
	crashBeforeClaim        = "before-claim"
	crashAfterClaim         = "after-claim"
	crashAfterCommit        = "after-commit"
	crashBeforeProviderCall = "before-provider-call"
	crashDuringProviderCall = "during-provider-call"
	crashAfterBodyWrite     = "after-body-write"
)

// crashStageKey is the context key under which withFaultInjection passes
// the stage to the hooks inside the handlers.
type crashStageKey struct{}

// withFaultInjection wraps the whole API, outside the idemhttp middleware,
// so that "before-claim" runs before any claim and "after-commit" sees the
// response only once idemhttp has committed and sends it.
func withFaultInjection(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		stage := r.Header.Get(crashHeader)
		switch stage {
		case "":
			next.ServeHTTP(w, r)
			return
		case crashBeforeClaim:
			crash()
		case crashAfterCommit:
			w = &crashOnWrite{ResponseWriter: w}
		case crashAfterClaim, crashBeforeProviderCall, crashDuringProviderCall, crashAfterBodyWrite:
		default:
			writeError(w, r, http.StatusBadRequest, "fault_stage_unknown", "Unknown X-Fault-Crash stage.")
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), crashStageKey{}, stage)))
	})
}

// crashAt kills the process if the request asked for a crash at stage. It
// does nothing without -fault-injection, whose wrapper alone sets a stage.
// idemhttp detaches the handler's context from the client's cancellation,
// not from its values, so the stage reaches the handlers.
func crashAt(ctx context.Context, stage string) {
	if s, _ := ctx.Value(crashStageKey{}).(string); s == stage {
		crash()
	}
}

// crash kills this process the way kill -9 would: no deferred function,
// no shutdown, no rollback sent to the database; the database and the
// kernel clean up after it.
func crash() {
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill() // SIGKILL on Unix
	}
	select {} // the signal is on its way; never run another line
}

// crashOnWrite kills the process at the first byte of the response.
type crashOnWrite struct{ http.ResponseWriter }

func (c *crashOnWrite) WriteHeader(int)           { crash() }
func (c *crashOnWrite) Write([]byte) (int, error) { crash(); return 0, nil }

// crashAfterPut wraps the body store so that a request that asked for it
// (X-Fault-Crash: after-body-write) kills the process once its response's
// body object is written, before the record that names it commits: in a
// DirBodyStore the object is durable and becomes an orphan; in a table
// store it is uncommitted rows of the transaction, which die with it.
func crashAfterPut[TTx any](bs idem.BodyStore) idem.BodyStore {
	if ts, ok := bs.(idem.TxBodyStore[TTx]); ok {
		return crashingTxBodies[TTx]{crashingBodies: crashingBodies{bs}, tx: ts}
	}
	return crashingBodies{bs}
}

type crashingBodies struct{ idem.BodyStore }

func (c crashingBodies) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	addr, err := c.BodyStore.Put(ctx, name, r)
	if err == nil {
		crashAt(ctx, crashAfterBodyWrite)
	}
	return addr, err
}

type crashingTxBodies[TTx any] struct {
	crashingBodies
	tx idem.TxBodyStore[TTx]
}

func (c crashingTxBodies[TTx]) PutTx(ctx context.Context, tx TTx, name string, r io.Reader) (string, error) {
	addr, err := c.tx.PutTx(ctx, tx, name, r)
	if err == nil {
		crashAt(ctx, crashAfterBodyWrite)
	}
	return addr, err
}
