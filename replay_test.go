package idem

import "testing"

// TestReplayGate: the moving average starts closed (a new service pays no
// read), opens after a run of replays, and closes again once first
// attempts dominate.
func TestReplayGate(t *testing.T) {
	var g replayGate
	if g.open() {
		t.Fatal("open before any answer")
	}
	opened := 0
	for i := 1; i <= 40 && opened == 0; i++ {
		g.note(answerReplayed)
		if g.open() {
			opened = i
		}
	}
	if opened < 5 || opened > 16 {
		t.Fatalf("opened after %d replays, want between 5 and 16", opened)
	}
	for range 40 {
		g.note(answerReplayed)
	}
	closed := 0
	for i := 1; i <= 40 && closed == 0; i++ {
		g.note(answerRan)
		if !g.open() {
			closed = i
		}
	}
	if closed < 5 || closed > 16 {
		t.Fatalf("closed after %d first attempts, want between 5 and 16", closed)
	}
	// Alternating answers (a replay share of one half) hover at the threshold;
	// a share of one third stays closed.
	for range 200 {
		g.note(answerReplayed)
		g.note(answerRan)
		g.note(answerRan)
	}
	if g.open() {
		t.Fatal("open at a replay share of one third")
	}
}

// TestConfigReplayRead: only the three settings are accepted.
func TestConfigReplayRead(t *testing.T) {
	for _, m := range []ReplayRead{ReplayReadAuto, ReplayReadAlways, ReplayReadNever} {
		c := (&Config{ReplayRead: m}).withDefaults()
		if err := c.validate(); err != nil {
			t.Fatalf("%d: %v", m, err)
		}
	}
	for _, m := range []ReplayRead{-1, ReplayReadNever + 1} {
		c := (&Config{ReplayRead: m}).withDefaults()
		if err := c.validate(); err == nil {
			t.Fatalf("%d accepted", m)
		}
	}
}
