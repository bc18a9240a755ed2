// A Go trainer's view of several prorl servers sharing a job store: one channel
// balanced over all of them with gRPC's round_robin policy, a batch of math
// tasks submitted with Submit, and each job followed with Watch. When a stream
// breaks with UNAVAILABLE (its server went away), the job is watched again
// from the last sequence number seen; on the round_robin channel that call
// goes to another server, which replays only what was missed.
//
// Usage:
//
//	cluster-client -targets 10.0.0.1:50051,10.0.0.2:50051,10.0.0.3:50051 -tasks 8
//	cluster-client -targets dns:///prorl.example:50051 -tasks 8
//
// Prints one line per event (`<job> #<seq> <kind>`), then `reward <job>
// <reward>` per job and `resumed <n>`, the Watch streams resumed after their
// server went away. Exits non-zero if a job did not finish.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	prorlv1 "prorl/gen/prorlv1"
)

// roundRobin spreads calls over every address the target resolves to (each
// call, a stream included, goes to the next ready server).
const roundRobin = `{"loadBalancingConfig":[{"round_robin":{}}]}`

func main() {
	targets := flag.String("targets", "localhost:50051",
		"the servers: host:port,host:port,... or one gRPC target such as dns:///name:port")
	tasks := flag.Int("tasks", 3, "math tasks to run")
	retries := flag.Int("retries", 5, "times in a row a broken Watch is resumed before giving up")
	restarts := flag.Uint("restarts", 0, "each job's retry.max_restarts: how often the cluster runs a job again when its server goes away")
	token := flag.String("token", os.Getenv("PRORL_TOKEN"), "bearer token, if the servers want one")
	timeout := flag.Duration("timeout", 10*time.Minute, "give up after this long")
	flag.Parse()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if *token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*token)
	}
	conn, err := dial(ctx, *targets)
	if err != nil {
		log.Fatalf("connect %s: %v", *targets, err)
	}
	defer conn.Close()
	client := prorlv1.NewRolloutServiceClient(conn)

	run := time.Now().UnixNano()
	jobs := make([]string, *tasks)
	for i := range jobs {
		jobs[i] = fmt.Sprintf("go-cluster-%d-%d", run, i)
		if _, err := client.Submit(ctx, &prorlv1.SubmitRequest{Rollout: mathTask(jobs[i], i, uint32(*restarts))}); err != nil {
			log.Fatalf("submit %s: %v", jobs[i], err)
		}
	}

	out := &printer{}
	results := make([]*prorlv1.RolloutResult, len(jobs))
	errs := make([]error, len(jobs))
	resumed := make([]int, len(jobs))
	var wg sync.WaitGroup
	for i, job := range jobs {
		wg.Add(1)
		go func(i int, job string) {
			defer wg.Done()
			results[i], resumed[i], errs[i] = follow(ctx, client, job, *retries, out)
		}(i, job)
	}
	wg.Wait()

	total, failed := 0, 0
	for i, job := range jobs {
		total += resumed[i]
		if errs[i] != nil {
			failed++
			log.Printf("%s did not finish: %v", job, errs[i])
			continue
		}
		fmt.Printf("reward %s %g\n", job, results[i].Reward)
	}
	fmt.Printf("resumed %d\n", total)
	if failed > 0 {
		log.Fatalf("%d of %d jobs did not finish", failed, len(jobs))
	}
}

// dial opens one channel over every server of `targets`: a comma-separated
// list of host:port goes through a resolver that hands gRPC all of them at
// once; a target with a scheme (dns:///name:port) is resolved by gRPC.
func dial(ctx context.Context, targets string) (*grpc.ClientConn, error) {
	options := []grpc.DialOption{
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithDefaultServiceConfig(roundRobin),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(codec{})),
	}
	target := targets
	if !strings.Contains(targets, ":///") {
		var addresses []resolver.Address
		for _, address := range strings.Split(targets, ",") {
			if address = strings.TrimSpace(address); address != "" {
				addresses = append(addresses, resolver.Address{Addr: address})
			}
		}
		servers := manual.NewBuilderWithScheme("prorl-servers")
		servers.InitialState(resolver.State{Addresses: addresses})
		options = append(options, grpc.WithResolvers(servers))
		target = servers.Scheme() + ":///servers"
	}
	return grpc.DialContext(ctx, target, options...)
}

func mathTask(job string, i int, restarts uint32) *prorlv1.RolloutRequest {
	instance, err := structpb.NewStruct(map[string]interface{}{
		"question": fmt.Sprintf("What is %d + %d?", i, i+1),
		"answer":   fmt.Sprintf("%d", 2*i+1),
	})
	if err != nil {
		log.Fatal(err)
	}
	maxTurns := int32(3)
	return &prorlv1.RolloutRequest{
		JobId:    job,
		Handler:  "math",
		Instance: instance,
		Limits:   &prorlv1.AgentLimits{MaxTurns: &maxTurns},
		Retry:    &prorlv1.RetryPolicy{MaxRestarts: restarts},
	}
}

// follow watches a job to its end, printing each event once and in order.
// A stream that breaks with UNAVAILABLE is resumed after the last seq seen,
// up to `retries` times in a row without an event in between, waiting a
// little longer each time.
func follow(ctx context.Context, client prorlv1.RolloutServiceClient, job string, retries int, out *printer) (*prorlv1.RolloutResult, int, error) {
	var after int64
	resumed, failures := 0, 0
	for {
		result, err := watch(ctx, client, job, &after, &failures, out)
		if err == nil {
			return result, resumed, nil
		}
		if status.Code(err) != codes.Unavailable || failures >= retries {
			return nil, resumed, err
		}
		delay := 100 * time.Millisecond << failures
		if delay > 5*time.Second {
			delay = 5 * time.Second
		}
		failures++
		resumed++
		select {
		case <-time.After(delay/2 + time.Duration(rand.Int63n(int64(delay/2)+1))):
		case <-ctx.Done():
			return nil, resumed, ctx.Err()
		}
	}
}

// watch runs one Watch stream from *after, advancing it with each event; a
// new event resets *failures. It returns the result once the job finished.
func watch(ctx context.Context, client prorlv1.RolloutServiceClient, job string, after *int64, failures *int, out *printer) (*prorlv1.RolloutResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Watch(ctx, &prorlv1.WatchRequest{JobId: job, AfterSeq: *after})
	if err != nil {
		return nil, err
	}
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			return nil, fmt.Errorf("the stream of %s ended before the job finished", job)
		}
		if err != nil {
			return nil, err
		}
		event := response.GetEvent()
		if event.Seq <= *after {
			continue // seen before the stream was resumed
		}
		*after, *failures = event.Seq, 0
		out.line(fmt.Sprintf("%s #%d %s", event.JobId, event.Seq, kind(event)))
		if finished := event.GetFinished(); finished != nil {
			return finished.Result, nil
		}
	}
}

// kind is the name of the event's oneof field, e.g. "model_turn".
func kind(event *prorlv1.RolloutEvent) string {
	message := event.ProtoReflect()
	field := message.WhichOneof(message.Descriptor().Oneofs().ByName("kind"))
	if field == nil {
		return "unknown"
	}
	return string(field.Name())
}

// printer writes whole lines from many goroutines.
type printer struct{ mu sync.Mutex }

func (p *printer) line(text string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Println(text)
}

// codec marshals with the current protobuf runtime (google.golang.org/protobuf):
// Debian's grpc-go 1.33 defaults to the legacy marshaller, which cannot encode
// the oneofs of today's generated messages (see rolloutclient).
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (codec) Unmarshal(data []byte, v interface{}) error {
	return proto.Unmarshal(data, v.(proto.Message))
}

func (codec) Name() string { return "proto" }
