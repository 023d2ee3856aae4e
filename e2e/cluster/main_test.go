package cluster

import (
	"context"
	"fmt"
	"os"
	"testing"

	"pvbridge.io/e2e/polling"
)

// childLabEnv makes the test binary, re-executed by TestKilledOwnerLeavesNothingBehind, start a
// lab and wait to be killed instead of running the tests.
const childLabEnv = "PVBRIDGE_TEST_CHILD_LAB"

func TestMain(m *testing.M) {
	polling.Set()
	if root := os.Getenv(childLabEnv); root != "" {
		if err := runChildLab(root); err != nil {
			fmt.Fprintln(os.Stderr, "child lab:", err)
			os.Exit(1)
		}
		return
	}
	os.Exit(m.Run())
}

// runChildLab starts a control plane with a fake-runtime node and a containerd node running a
// pod under root, says READY, and blocks until it is killed; it never calls Stop.
func runChildLab(root string) error {
	bin, err := DefaultBinaries()
	if err != nil {
		return err
	}
	lab, err := NewLab(root, bin)
	if err != nil {
		return err
	}
	ctx := context.Background()
	cp, err := lab.StartControlPlane(ctx, "child")
	if err != nil {
		return err
	}
	if _, err := cp.AddNode(ctx, "node-1", NodeOptions{}); err != nil {
		return err
	}
	archives, err := labImageArchives(lab)
	if err != nil {
		return err
	}
	if _, err := cp.AddNode(ctx, "node-2", NodeOptions{Runtime: Containerd, Images: archives}); err != nil {
		return err
	}
	if err := runBusybox(ctx, cp.Client(), "node-2", "orphan", "exec sleep 3601"); err != nil {
		return err
	}
	fmt.Println("READY")
	select {}
}
