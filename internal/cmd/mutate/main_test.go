package main

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

const sample = "package p\n\n" +
	"const q = `UPDATE t SET a = 1\n" +
	"WHERE scope = ? AND token = ? AND (NOT ? OR lease <= ?)\n" +
	"FOR UPDATE`\n\n" +
	"func f(a, b int, ok bool) int {\n" +
	"\tif a < b && !ok {\n" +
	"\t\treturn 8\n" +
	"\t}\n" +
	"\treturn 0\n" +
	"}\n"

// TestGenerate checks the mutants of a small file: every operator is
// found, each mutant is the intended edit, and each still parses (so a
// mutant that fails to build is the tester's bug, not the suite's kill).
func TestGenerate(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "p.go")
	if err := os.WriteFile(file, []byte(sample), 0o644); err != nil {
		t.Fatal(err)
	}
	ms, err := generate(file)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{} // op and replaced text -> mutated line
	for _, m := range ms {
		mutated := sample[:m.start] + m.repl + sample[m.end:]
		if _, err := parser.ParseFile(token.NewFileSet(), "m.go", mutated, 0); err != nil {
			t.Errorf("%s (%s) does not parse: %v", m.ID, m.Desc, err)
		}
		got[m.Op+" "+sample[m.start:m.end]+"->"+m.repl] = m.ID
	}
	for _, want := range []string{
		"sqldrop AND token = ?->",
		"sqldrop AND (NOT ? OR lease <= ?)->",
		"sqlcmp <=-><",
		"sqllock FOR UPDATE->",
		"sqlnot NOT ->",
		"cmp <-><=",
		"cmp &&->||",
		"not !->",
		"skipif a < b && !ok->false",
		"const 8->9",
		"const 0->1",
	} {
		if _, ok := got[want]; !ok {
			keys := make([]string, 0, len(got))
			for k := range got {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			t.Errorf("no mutant %q; have %q", want, keys)
		}
	}
	if len(ms) != 11 {
		t.Errorf("%d mutants, want 11", len(ms))
	}
}
