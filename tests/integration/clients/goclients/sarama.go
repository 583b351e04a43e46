package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/IBM/sarama"
)

type saramaClient struct{ cfg func() *sarama.Config }

func newSarama() saramaClient {
	return saramaClient{cfg: func() *sarama.Config {
		c := sarama.NewConfig()
		if v := os.Getenv("SARAMA_VERSION"); v != "" {
			ver, err := sarama.ParseKafkaVersion(v)
			if err != nil {
				fail("SARAMA_VERSION: %v", err)
			}
			c.Version = ver
		}
		c.Consumer.IsolationLevel = sarama.ReadCommitted
		c.Consumer.Return.Errors = true
		c.Consumer.Offsets.Initial = sarama.OffsetOldest
		return c
	}}
}

func smHeaders(hs []*sarama.RecordHeader) []header {
	var out []header
	for _, h := range hs {
		out = append(out, header{string(h.Key), h.Value})
	}
	return out
}

type smMsg struct {
	m   *sarama.ConsumerMessage
	err error
}

// partition consumers of every partition from the oldest offset, their messages on one channel
func (s saramaClient) partitions(bs, topic string, n int) (sarama.Consumer, chan smMsg) {
	c, err := sarama.NewConsumer([]string{bs}, s.cfg())
	if err != nil {
		fail("NewConsumer: %v", err)
	}
	ch := make(chan smMsg, 1024)
	for p := 0; p < n; p++ {
		pc, err := c.ConsumePartition(topic, int32(p), sarama.OffsetOldest)
		if err != nil {
			fail("ConsumePartition: %v", err)
		}
		go func() {
			for m := range pc.Messages() {
				ch <- smMsg{m: m}
			}
		}()
		go func() {
			for e := range pc.Errors() {
				ch <- smMsg{err: e}
			}
		}()
	}
	return c, ch
}

func (s saramaClient) drain(t *tracker, ch chan smMsg, until <-chan time.Time, stopWhenDone bool) {
	for !(stopWhenDone && t.done()) {
		select {
		case m := <-ch:
			if m.err != nil {
				fail("consume: %v", m.err)
			}
			t.add(int(m.m.Partition), m.m.Offset, m.m.Timestamp, m.m.Key, m.m.Value,
				smHeaders(m.m.Headers))
		case <-until:
			if stopWhenDone {
				fail("not every record came in 30 s: %s", t.missing())
			}
			return
		}
	}
}

func (s saramaClient) read(bs, topic string, lasts []int64) {
	t := newTracker(topic, lasts, false)
	c, ch := s.partitions(bs, topic, len(lasts))
	s.drain(t, ch, time.After(readTimeout), true)
	s.drain(t, ch, time.After(2*time.Second), false) // a record delivered again fails here
	// sarama does not say a partition consumer's position
	pos := map[int]*int64{}
	for p := range lasts {
		pos[p] = nil
	}
	emit(map[string]any{"positions": intKeys(pos)})
	c.Close()
}

func (s saramaClient) idle(bs, topic string, lasts []int64, d time.Duration) {
	t := newTracker(topic, lasts, true)
	c, ch := s.partitions(bs, topic, len(lasts))
	s.drain(t, ch, time.After(readTimeout), true)
	emit(map[string]any{"idle": "start"})
	before := t.count
	s.drain(t, ch, time.After(d), false)
	emit(map[string]any{"idle": "end", "records": t.count - before})
	c.Close()
}

type smHandler struct {
	t     *tracker
	limit int // stop after this many records in all (0: until every last record came)
	mu    *sync.Mutex
	stop  context.CancelFunc
}

func (h *smHandler) Setup(sarama.ConsumerGroupSession) error { return nil }

// Cleanup commits what ConsumeClaim marked (a commit per message would take a round trip each)
func (h *smHandler) Cleanup(sess sarama.ConsumerGroupSession) error {
	sess.Commit()
	return nil
}
func (h *smHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for m := range claim.Messages() {
		h.mu.Lock()
		if h.limit > 0 && h.t.count >= h.limit {
			h.mu.Unlock()
			h.stop()
			return nil
		}
		h.t.add(int(m.Partition), m.Offset, m.Timestamp, m.Key, m.Value, smHeaders(m.Headers))
		sess.MarkMessage(m, "")
		full := h.limit > 0 && h.t.count >= h.limit
		h.mu.Unlock()
		if full {
			h.stop()
			return nil
		}
	}
	return nil
}

func (s saramaClient) member(bs, topic, group string, t *tracker, limit int, mu *sync.Mutex,
	until func() bool, timeout time.Duration) {
	cfg := s.cfg()
	cfg.Consumer.Offsets.AutoCommit.Enable = false
	g, err := sarama.NewConsumerGroup([]string{bs}, group, cfg)
	if err != nil {
		fail("NewConsumerGroup: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h := &smHandler{t: t, limit: limit, mu: mu, stop: cancel}
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			if err := g.Consume(ctx, []string{topic}, h); err != nil {
				if !errors.Is(err, sarama.ErrClosedConsumerGroup) {
					done <- err
				}
				return
			}
		}
		done <- nil
	}()
	go func() {
		for e := range g.Errors() {
			done <- e
		}
	}()
	deadline := time.Now().Add(timeout)
	for ctx.Err() == nil {
		mu.Lock()
		ok := until()
		mu.Unlock()
		if ok {
			cancel()
			break
		}
		if time.Now().After(deadline) {
			mu.Lock()
			fail("the group member did not finish in %v: %d records, %s", timeout, t.count,
				t.missing())
		}
		select {
		case err := <-done:
			if err != nil {
				fail("consumer group: %v", err)
			}
		case <-time.After(100 * time.Millisecond):
		}
	}
	g.Close()
}

func (s saramaClient) group(bs, topic string, lasts []int64, group string, n int) {
	t := newTracker(topic, lasts, false)
	mu := &sync.Mutex{}
	s.member(bs, topic, group, t, n, mu, func() bool { return t.count >= n }, readTimeout)
	var doneAt time.Time
	s.member(bs, topic, group, t, 0, mu, func() bool {
		if !t.done() {
			return false
		}
		if doneAt.IsZero() {
			doneAt = time.Now()
		}
		return time.Since(doneAt) > 3*time.Second // a record delivered again fails meanwhile
	}, readTimeout+5*time.Second)
	admin, err := sarama.NewClusterAdmin([]string{bs}, s.cfg())
	if err != nil {
		fail("NewClusterAdmin: %v", err)
	}
	defer admin.Close()
	var parts []int32
	for p := range lasts {
		parts = append(parts, int32(p))
	}
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
	if err != nil {
		fail("ListConsumerGroupOffsets: %v", err)
	}
	committed := map[int]int64{}
	for p, b := range resp.Blocks[topic] {
		committed[int(p)] = b.Offset
	}
	emit(map[string]any{"committed": intKeys(committed)})
}

func (s saramaClient) offsets(bs, topic string, partitions int) {
	c, err := sarama.NewClient([]string{bs}, s.cfg())
	if err != nil {
		fail("NewClient: %v", err)
	}
	defer c.Close()
	out := map[string]map[string]int64{"earliest": {}, "latest": {}}
	for p := 0; p < partitions; p++ {
		for name, at := range map[string]int64{"earliest": sarama.OffsetOldest,
			"latest": sarama.OffsetNewest} {
			o, err := c.GetOffset(topic, int32(p), at)
			if err != nil {
				fail("GetOffset %d %s: %v", p, name, err)
			}
			out[name][fmt.Sprint(p)] = o
		}
	}
	emit(map[string]any{"earliest": out["earliest"], "latest": out["latest"]})
}

func (s saramaClient) produce(bs, topic string) {
	cfg := s.cfg()
	cfg.Producer.Return.Successes = true
	p, err := sarama.NewSyncProducer([]string{bs}, cfg)
	if err != nil {
		emit(map[string]any{"produce_error": fmt.Sprintf("%T: %v", err, err)})
		return
	}
	defer p.Close()
	_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"),
		Value: sarama.StringEncoder("v")})
	if err == nil {
		emit(map[string]any{"produced": true})
		return
	}
	var pe *sarama.ProducerError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	emit(map[string]any{"produce_error": fmt.Sprintf("%T: %v", err, err)})
}
