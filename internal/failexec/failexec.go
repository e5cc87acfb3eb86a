// Package failexec provides an idem.Executor that fails every call, which
// the dialects return for a nil transaction instead of panicking later.
package failexec

import (
	"context"
	"time"

	"github.com/idemstore/idem"
)

// Executor answers every call with Err.
type Executor struct{ Err error }

var _ idem.Executor = Executor{}

// Claim implements idem.Executor.
func (f Executor) Claim(context.Context, *idem.ClaimParams) (*idem.ClaimResult, error) {
	return nil, f.Err
}

// Takeover implements idem.Executor.
func (f Executor) Takeover(context.Context, *idem.TakeoverParams) error { return f.Err }

// Get implements idem.Executor.
func (f Executor) Get(context.Context, *idem.GetParams) (*idem.Record, error) { return nil, f.Err }

// Complete implements idem.Executor.
func (f Executor) Complete(context.Context, *idem.CompleteParams) error { return f.Err }

// Release implements idem.Executor.
func (f Executor) Release(context.Context, *idem.ReleaseParams) error { return f.Err }

// RenewLease implements idem.Executor.
func (f Executor) RenewLease(context.Context, *idem.RenewLeaseParams) (time.Time, error) {
	return time.Time{}, f.Err
}

// ListStaleLeases implements idem.Executor.
func (f Executor) ListStaleLeases(context.Context, *idem.ListStaleLeasesParams) ([]*idem.Record, time.Time, error) {
	return nil, time.Time{}, f.Err
}

// DeleteExpired implements idem.Executor.
func (f Executor) DeleteExpired(context.Context, *idem.DeleteExpiredParams) (int, error) {
	return 0, f.Err
}
