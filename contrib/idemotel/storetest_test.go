package idemotel_test

import (
	"testing"

	"github.com/idemstore/idem/internal/storetest"
)

type (
	harness[TTx any]   = storetest.Harness[TTx]
	namespace[TTx any] = storetest.Namespace[TTx]
)

func TestMain(m *testing.M) { storetest.Main(m) }
