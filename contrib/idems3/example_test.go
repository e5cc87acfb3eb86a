package idems3_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idems3"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// TestMain leaves the example out when there is no S3 server to run it
// against (an example cannot skip): the tests then skip one by one, or
// fail under CI or IDEM_TEST_REQUIRE_S3=1, and the example runs with them.
func TestMain(m *testing.M) {
	flag.Parse()
	if os.Getenv(endpointEnv) == "" && !s3Required() && flag.Lookup("test.run").Value.String() == "" {
		fmt.Fprintf(os.Stderr, "idems3: %s is not set: the example does not run and the tests skip (cd contrib/idems3 && bash ../../.ci/s3.sh run go test ./...)\n", endpointEnv)
		_ = flag.Set("test.run", "^Test")
	}
	os.Exit(m.Run())
}

// Responses over 64 KiB (Config.InlineBodyMax) go to an S3 bucket while
// the handler writes them; the record keeps the object's address, length
// and SHA-256, and a retry replays the object.
func Example() {
	ctx := context.Background()
	// The S3 client: endpoint, region and credentials are the
	// application's (here the test server's; config.LoadDefaultConfig
	// reads them from the environment).
	client := s3.New(s3.Options{
		BaseEndpoint: aws.String(os.Getenv("IDEM_TEST_S3_ENDPOINT")),
		Region:       "us-east-1",
		UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider(
			os.Getenv("IDEM_TEST_S3_ACCESS_KEY"), os.Getenv("IDEM_TEST_S3_SECRET_KEY"), ""),
	})
	bodies, err := idems3.New(idems3.Config{Client: client, Bucket: os.Getenv("IDEM_TEST_S3_BUCKET"), Prefix: "example/bodies/"})
	if err != nil {
		log.Fatal(err)
	}

	dir, err := os.MkdirTemp("", "idems3")
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
	store, err := idem.New(idemsqlite.New(db), &idem.Config{BodyStore: bodies})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.New(store, &idemhttp.Config{Tenant: func(*http.Request) (string, error) { return "acme", nil }})
	if err != nil {
		log.Fatal(err)
	}
	runs := 0
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Header().Set("Content-Type", "text/csv")
		for i := range 20000 {
			fmt.Fprintf(w, "order-%05d,100\n", i)
		}
	})))
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/exports", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "export-2026-12")
		req.Header.Set("Content-Type", "application/json")
		resp, err := srv.Client().Do(req)
		if err != nil {
			log.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, n, "bytes, replayed:", resp.Header.Get("Idempotency-Replayed") == "true")
	}
	fmt.Println("handler runs:", runs)

	// The reaper deletes an object after its record; this removes the
	// example's own.
	_ = bodies.List(ctx, time.Now().Add(time.Hour), func(addr string) error { return bodies.Delete(ctx, addr) })
	// Output:
	// 200 320000 bytes, replayed: false
	// 200 320000 bytes, replayed: true
	// handler runs: 1
}
