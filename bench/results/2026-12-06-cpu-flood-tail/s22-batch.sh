#!/bin/bash
D="--accept-share 0.25 --defer-accept on"
for i in 1 2 3; do
  /tmp/s22-run.sh ab-off-nice$i $D --refuse-reset off --attacker-nice 19
  /tmp/s22-run.sh ab-on-nice$i $D --refuse-reset on --attacker-nice 19
  /tmp/s22-run.sh ab-off-plain$i $D --refuse-reset off
done
/tmp/s22-run.sh wide-off-nice $D --refuse-reset off --attacker-nice 19 --concurrency 2000
/tmp/s22-run.sh wide-on-nice $D --refuse-reset on --attacker-nice 19 --concurrency 2000
