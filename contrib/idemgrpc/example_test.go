package idemgrpc_test

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemgrpc"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// A server whose Charge method is protected, and a client that sends the
// same call twice with one key: the second answer is the stored one.
func Example() {
	dir, _ := os.MkdirTemp("", "idemgrpc-example")
	defer func() { _ = os.RemoveAll(dir) }()
	ctx := context.Background()
	db, _ := idemsqlite.Open(filepath.Join(dir, "app.db"))
	defer func() { _ = db.Close() }()
	_ = idemsqlite.Migrate(ctx, db)
	_, _ = db.ExecContext(ctx, `CREATE TABLE charges (id INTEGER PRIMARY KEY, cents INTEGER NOT NULL)`)

	store, _ := idem.New(idemsqlite.New(db), nil)
	ic, err := idemgrpc.UnaryServerInterceptor(store, &idemgrpc.Config{
		Protect: idemgrpc.Methods("/pay.v1.Payments/Charge"),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(ic))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "pay.v1.Payments",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Charge",
			Handler: func(_ any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
				in := new(wrapperspb.Int64Value)
				if err := dec(in); err != nil {
					return nil, err
				}
				info := &grpc.UnaryServerInfo{FullMethod: "/pay.v1.Payments/Charge"}
				return ic(ctx, in, info, func(ctx context.Context, req any) (any, error) {
					tx, _ := idemgrpc.Tx[*sql.Tx](ctx) // the key is claimed in tx
					res, err := tx.ExecContext(ctx, `INSERT INTO charges (cents) VALUES (?)`, req.(*wrapperspb.Int64Value).GetValue())
					if err != nil {
						return nil, err
					}
					id, _ := res.LastInsertId()
					return wrapperspb.String(fmt.Sprintf("charge %d", id)), nil
				})
			},
		}},
	}, nil)
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	conn, _ := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer func() { _ = conn.Close() }()
	callCtx := metadata.AppendToOutgoingContext(ctx, "idempotency-key", "charge-7f3a9c2e41")
	for range 2 {
		var header metadata.MD
		out := new(wrapperspb.StringValue)
		if err := conn.Invoke(callCtx, "/pay.v1.Payments/Charge", wrapperspb.Int64(1999), out, grpc.Header(&header)); err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%s, replayed: %v\n", out.GetValue(), header.Get(idemgrpc.ReplayedHeader))
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM charges`).Scan(&n)
	fmt.Println("charges:", n)
	// Output:
	// charge 1, replayed: []
	// charge 1, replayed: [true]
	// charges: 1
}
